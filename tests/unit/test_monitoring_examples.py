"""The Prometheus configuration the README tells operators to copy (examples/monitoring/prometheus.yml):
`promtool check config` passes it with the shipped rule files where its rule_files glob reads them; and
examples/monitoring/prometheus-prometheus-vars.yml, the same for the prometheus.prometheus collection's
prometheus and alertmanager roles, says what it and roles/monitoring/files/alertmanager-selfheal.yml
(checked by amtool: test_alertmanager_config.py) say - one source of truth, kept so by this test."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from promtool import promtool

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "monitoring"
FILES = REPO / "roles" / "monitoring" / "files"
RULES_DIR = "/etc/prometheus/rules/"


def test_the_example_prometheus_config_passes_promtool_with_the_shipped_rules(tmp_path: Path) -> None:
    text = (EXAMPLES / "prometheus.yml").read_text()
    assert f"{RULES_DIR}*.yml" in text
    (tmp_path / "rules").mkdir()
    for rules in ("hsx.rules.yml", "hsx-selfheal.rules.yml"):  # where roles/monitoring installs them
        shutil.copy(FILES / rules, tmp_path / "rules" / rules)
    (tmp_path / "prometheus.yml").write_text(text.replace(RULES_DIR, f"{tmp_path}/rules/"))
    checked = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    out = (checked.stdout + checked.stderr).decode()
    assert checked.returncode == 0 and "SUCCESS: 2 rule files found" in out, out
    config = yaml.safe_load(text)
    nodes = [c for c in config["scrape_configs"] if c["job_name"] == "node"][0]
    assert all(s["labels"].get("hsx_host") for s in nodes["static_configs"]), "every node target names its hsx_host"
    control = [c for c in config["scrape_configs"] if c["job_name"] == "hsx-control"][0]
    assert all("hsx_host" not in s.get("labels", {}) for s in control["static_configs"])


def test_the_prometheus_prometheus_variables_say_what_the_pasted_configs_say() -> None:
    prom = yaml.safe_load((EXAMPLES / "prometheus.yml").read_text())
    am = yaml.safe_load((FILES / "alertmanager-selfheal.yml").read_text())
    roles_vars = yaml.safe_load((EXAMPLES / "prometheus-prometheus-vars.yml").read_text())
    assert roles_vars["prometheus_scrape_configs"] == prom["scrape_configs"]
    assert roles_vars["prometheus_alertmanager_config"] == prom["alerting"]["alertmanagers"]
    assert {k: roles_vars["prometheus_global"][k] for k in prom["global"]} == prom["global"]
    assert "monitoring_rules_files" in roles_vars["prometheus_alert_rules_files"]
    assert roles_vars["alertmanager_route"] == am["route"]
    assert roles_vars["alertmanager_receivers"] == am["receivers"]
