"""Alertmanager's side of self-healing (roles/monitoring/files/alertmanager-selfheal.yml, the snippet
the README's "Self-healing" tells operators to copy): `amtool check-config` (Debian's
prometheus-alertmanager) passes it, and its route sends exactly the alerts that carry a remedy to the
rulebook's receiver, one host and alert per notification (`amtool config routes test`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "roles" / "monitoring" / "files" / "alertmanager-selfheal.yml"
RULEBOOK = REPO / "extensions" / "eda" / "rulebooks" / "selfheal.yml"


@pytest.fixture(scope="module")
def amtool() -> str:
    path = shutil.which("amtool")
    if not path:
        pytest.skip("amtool is not installed (make lab-ensure installs prometheus-alertmanager)")
    return path


def test_amtool_check_config_passes(amtool: str) -> None:
    checked = subprocess.run([amtool, "check-config", str(CONFIG)], capture_output=True, text=True)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr


@pytest.mark.parametrize(("labels", "receivers"), [
    (["alertname=HsxSelfHealStalled", "hsx_remedy=recover", "hsx_host=n1"], "hsx-selfheal,people"),
    (["alertname=HsxSelfHealNodeDown", "hsx_remedy=takeover", "hsx_host=n1"], "hsx-selfheal,people"),
    (["alertname=HsxSelfHealGaveUp", "hsx_host=n1"], "people"),
    (["alertname=HsxJobStalled"], "people"),
])
def test_only_remedy_alerts_reach_the_rulebook_and_people_still_see_them(amtool, labels, receivers) -> None:
    routed = subprocess.run([amtool, "config", "routes", "test", f"--config.file={CONFIG}", *labels],
                            capture_output=True, text=True)
    assert routed.returncode == 0 and routed.stdout.strip() == receivers, routed.stdout + routed.stderr


def test_the_route_posts_to_the_rulebooks_default_listener() -> None:
    am = yaml.safe_load(CONFIG.read_text())
    url = am["receivers"][1]["webhook_configs"][0]["url"]
    source = yaml.safe_load(RULEBOOK.read_text())[0]["sources"][0]["hsx_webhook"]
    assert url.startswith("http://127.0.0.1:5050/"), url
    assert "127.0.0.1" in source["host"] and "5050" in str(source["port"]), source
    assert am["route"]["routes"][0]["group_by"] == ["alertname", "hsx_host"]
