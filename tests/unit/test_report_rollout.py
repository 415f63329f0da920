"""The rollout's part of the report: per-host patch versions and why the rollout stopped."""

from __future__ import annotations

import json

from extraction.fleet.report import build


def _facts(host: str, outcome: str, running: str, failed: bool = False) -> dict:
    facts = {
        "host": host,
        "mode": "apply",
        "sglang_patch_result": {"state": "present", "before": "outdated", "after": "patched", "version": "0.5.10",
                                "patch_version": "4", "check_mode": False},
        "sglang_server_result": {"unit": "hsx-sglang-server.service", "active_state": "active", "healthy": True},
        "rollout_result": {"from_version": "3", "to_version": "4", "running_version": running, "outcome": outcome,
                           "halted": True, "halt_reason": "h2 failed in batch 2"},
    }
    if failed:
        facts.update(failed_stage="server", failed_task="Wait until /health answers 200", failed_msg="no health")
    return facts


def test_summary_says_which_host_runs_which_version(tmp_path):
    (tmp_path / "facts").mkdir()
    hosts = {"h1": ("updated", "4", False), "h2": ("reverted to v3", "3", True),
             "h3": ("not touched (rollout stopped: h2 failed in batch 2)", "3", False)}
    for host, (outcome, running, failed) in hosts.items():
        (tmp_path / "facts" / f"{host}.json").write_text(json.dumps(_facts(host, outcome, running, failed)))
    (tmp_path / "hosts.json").write_text(json.dumps(list(hosts)))
    reports, summary_path = build(tmp_path, "Patch rollout report")
    summary = summary_path.read_text()
    ok = {r["host"]: r["ok"] for r in reports}
    assert ok == {"h1": True, "h2": False, "h3": True}
    assert "- h1: runs v4 (updated; was v3, target v4)" in summary
    assert "- h2: runs v3 (reverted to v3; was v3, target v4)" in summary
    assert "- h3: runs v3 (not touched (rollout stopped: h2 failed in batch 2); was v3, target v4)" in summary
    assert "The rollout stopped: h2 failed in batch 2." in summary
    assert "| h1 | yes |" in summary and "| v4 |" in summary.split("| h1 |")[1].split("\n")[0] + "|"
    checks = {c["name"]: c for c in reports[0]["checks"]}
    assert checks["patch"]["ok"] and "outdated -> patched (patch v4)" in checks["patch"]["detail"]
    assert checks["server"]["ok"] and checks["server"]["detail"].endswith(": active")


def test_a_server_installed_but_not_started_on_purpose_is_ok(tmp_path):
    (tmp_path / "facts").mkdir()
    server = {"unit": "hsx-sglang-server.service", "active_state": "inactive", "healthy": False}
    for host, requested in (("p1", False), ("p2", True)):
        (tmp_path / "facts" / f"{host}.json").write_text(
            json.dumps({"host": host, "sglang_server_result": dict(server, start_requested=requested)}))
    reports, _ = build(tmp_path, "Provisioning report")
    assert [r["ok"] for r in reports] == [True, False]
