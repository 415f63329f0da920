"""The alert rules roles/monitoring ships (hsx.rules.yml): `promtool check rules` clean, and
`promtool test rules` (tests/unit/data/hsx.rules.test.yml) shows each alert firing when it should
and quiet when it should not. A rule that never fires fails its test: checked for every alert."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from promtool import promtool

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "roles" / "monitoring" / "files" / "hsx.rules.yml"
TESTS = REPO / "tests" / "unit" / "data" / "hsx.rules.test.yml"


def alerts() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_check_rules() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0 and b"SUCCESS" in checked.stdout, checked


def test_promtool_test_rules() -> None:
    tested = promtool("test", "rules", str(TESTS))
    assert tested.returncode == 0 and b"SUCCESS" in tested.stdout, tested.stdout.decode() + tested.stderr.decode()


def test_every_alert_is_tested_and_follows_the_conventions() -> None:
    tested = set(re.findall(r"alertname: (\w+)", TESTS.read_text()))
    for rule in alerts():
        assert rule["alert"] in tested, f"{rule['alert']} has no promtool test"
        assert rule["alert"].startswith("Hsx") and rule["labels"]["severity"] in ("warning", "critical")
        assert {"summary", "action"} <= rule["annotations"].keys(), rule["alert"]


@pytest.mark.parametrize("name", [a["alert"] for a in alerts()])
def test_an_alert_that_never_fires_fails_its_tests(name: str, tmp_path: Path) -> None:
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == name:
                rule["expr"] = "absent(vector(1))"  # an empty vector: never fires
    (tmp_path / "hsx.rules.yml").write_text(yaml.safe_dump(doc))
    cases = yaml.safe_load(TESTS.read_text())
    cases["rule_files"] = ["hsx.rules.yml"]
    (tmp_path / "t.yml").write_text(yaml.safe_dump(cases))
    tested = promtool("test", "rules", str(tmp_path / "t.yml"))
    said = (tested.stdout + tested.stderr).decode()
    assert tested.returncode != 0 and f"alertname: {name}," in said, said
