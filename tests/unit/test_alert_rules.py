"""The alert rules roles/monitoring ships (hsx.rules.yml, and hsx-selfheal.rules.yml: the alerts that
drive self-healing): `promtool check rules` clean, and `promtool test rules`
(tests/unit/data/<name>.test.yml) shows each alert firing when it should and quiet when it should
not. A rule that never fires fails its test: checked for every alert."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from promtool import promtool

REPO = Path(__file__).resolve().parents[2]
FILES = REPO / "roles" / "monitoring" / "files"
RULE_FILES = ["hsx.rules.yml", "hsx-selfheal.rules.yml"]


def cases_of(name: str) -> Path:
    return REPO / "tests" / "unit" / "data" / name.replace(".yml", ".test.yml")


def alerts(name: str) -> list[dict]:
    return [r for g in yaml.safe_load((FILES / name).read_text())["groups"] for r in g["rules"] if "alert" in r]


@pytest.mark.parametrize("name", RULE_FILES)
def test_promtool_check_rules(name: str) -> None:
    checked = promtool("check", "rules", str(FILES / name))
    assert checked.returncode == 0 and b"SUCCESS" in checked.stdout, checked


@pytest.mark.parametrize("name", RULE_FILES)
def test_promtool_test_rules(name: str) -> None:
    tested = promtool("test", "rules", str(cases_of(name)))
    assert tested.returncode == 0 and b"SUCCESS" in tested.stdout, tested.stdout.decode() + tested.stderr.decode()


@pytest.mark.parametrize("name", RULE_FILES)
def test_every_alert_is_tested_and_follows_the_conventions(name: str) -> None:
    tested = set(re.findall(r"alertname: (\w+)", cases_of(name).read_text()))
    for rule in alerts(name):
        assert rule["alert"] in tested, f"{rule['alert']} has no promtool test"
        assert rule["alert"].startswith("Hsx") and rule["labels"]["severity"] in ("warning", "critical")
        assert {"summary", "action"} <= rule["annotations"].keys(), rule["alert"]


@pytest.mark.parametrize(("file", "name"), [(f, a["alert"]) for f in RULE_FILES for a in alerts(f)])
def test_an_alert_that_never_fires_fails_its_tests(file: str, name: str, tmp_path: Path) -> None:
    doc = yaml.safe_load((FILES / file).read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == name:
                rule["expr"] = "absent(vector(1))"  # an empty vector: never fires
    (tmp_path / file).write_text(yaml.safe_dump(doc))
    cases = yaml.safe_load(cases_of(file).read_text())
    cases["rule_files"] = [file]
    (tmp_path / "t.yml").write_text(yaml.safe_dump(cases))
    tested = promtool("test", "rules", str(tmp_path / "t.yml"))
    said = (tested.stdout + tested.stderr).decode()
    assert tested.returncode != 0 and f"alertname: {name}," in said, said
