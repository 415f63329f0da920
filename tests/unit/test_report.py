"""extraction/fleet/report.py: per-host JSON and summary.md from the facts recover.yml dumps."""

from __future__ import annotations

import io
import json

import pytest

from extraction.cli import build_parser, main
from extraction.fleet.playbook import run_playbook
from extraction.fleet.report import build, host_report, stage_of_task, summary_markdown

RECOVERED = {
    "host": "node-1", "mode": "apply",
    "status_before": {"state": "running", "done": 128, "total": 256, "pid_alive": False},
    "status_after": {"state": "running", "done": 140, "total": 256, "making_progress": True},
    "node_assess_report": {"units_running": ["vllm-kimi-k25-int4.service"], "data_mount": {"mounted": True}},
    "gpu_reclaim_result": {"units_running": ["vllm-kimi-k25-int4.service"], "units_changed": ["vllm-kimi-k25-int4.service"],
                           "processes_ended": [{"pid": 7}], "gpus": 8, "failed": False},
    "storage_guard_result": {"mount": "/data", "free_bytes": "9000", "need_bytes": "100", "remaining_samples": "128"},
    "shard_verify_result": {"level": "full", "ok": 125, "bad_count": 3, "missing_count": 0,
                            "quarantined": ["a", "b", "c"], "orphans_removed": 2},
    "extraction_deploy_result": {"version": "0.1.0", "venv": "/opt/hsx/venv", "installed": True},
    "extraction_job_result": {"unit": "hsx-extraction.service", "active_state": "active", "state": "running",
                              "done": 140, "total": 256, "samples_per_s": 12.5, "making_progress": True},
}
BROKEN = {"host": "node-4", "mode": "apply", "failed_stage": "storage", "failed_task": "The data mount must be mounted",
          "failed_msg": "/data is not mounted on node-4", "status_before": {"done": 128, "total": 256},
          "node_assess_report": {"units_running": [], "data_mount": {"mounted": False}}}


def test_recovered_host_is_ok_with_before_and_after():
    r = host_report(RECOVERED)
    assert r["ok"] and r["failed_step"] is None
    assert [c["name"] for c in r["checks"]] == ["assess", "gpus", "storage", "shards", "deploy", "job"]
    assert r["before"]["progress"]["done"] == 128 and r["after"]["progress"]["done"] == 140
    assert r["after"]["shards_quarantined"] == 3 and r["after"]["processes_ended"] == 1


def test_unquarantined_bad_shards_make_the_host_not_ok():
    facts = json.loads(json.dumps(RECOVERED))
    facts["shard_verify_result"]["quarantined"] = []
    r = host_report(facts)
    assert not r["ok"] and not {c["name"]: c for c in r["checks"]}["shards"]["ok"]


def test_a_stalled_job_is_not_ok():
    facts = json.loads(json.dumps(RECOVERED))
    facts["extraction_job_result"].update(making_progress=False, state="running")
    assert not host_report(facts)["ok"]


def test_failed_host_names_the_step_and_the_reason():
    r = host_report(BROKEN)
    assert not r["ok"] and r["failed_step"] == "storage" and "not mounted" in r["reason"]


def test_stage_from_role_prefixed_task_names():
    assert stage_of_task("storage_guard : The data mount must be mounted") == "storage"
    assert stage_of_task("gpu_reclaim : Stop units") == "gpus"
    assert stage_of_task("something else") is None


def test_build_writes_reports_and_marks_hosts_without_facts_unreachable(tmp_path, capsys):
    (tmp_path / "facts").mkdir()
    for facts in (RECOVERED, BROKEN):
        (tmp_path / "facts" / f"{facts['host']}.json").write_text(json.dumps(facts))
    (tmp_path / "hosts.json").write_text(json.dumps(["node-1", "node-4", "node-9"]))
    reports, summary = build(tmp_path)
    assert [r["ok"] for r in reports] == [True, False, False]
    assert json.loads((tmp_path / "node-9.json").read_text())["failed_step"] == "connect"
    text = summary.read_text()
    assert "1 of 3 hosts ok." in text and "**node-4**: step `storage`" in text and "unreachable" in text
    # before: status.json still said running, but the crashed process was gone
    assert "| node-1 | yes | 128/256 (running, process gone) | 140/256 (running) |" in text
    assert main(["report", str(tmp_path), "--quiet"]) == 1


@pytest.mark.parametrize(
    ("alive", "shown"),
    [(False, "128/256 (running, process gone)"), (True, "128/256 (running)"), (None, "128/256 (running)")],
)
def test_samples_before_says_when_the_running_process_is_gone(alive, shown):
    """A status.json left as "running" by a crashed run must not read as a live run; a live one,
    or one on another host (None: cannot tell), reads as it says."""
    facts = json.loads(json.dumps(RECOVERED))
    facts["status_before"]["pid_alive"] = alive
    assert f"| node-1 | yes | {shown} |" in summary_markdown([host_report(facts)], "t")


def test_not_a_report_dir_is_a_usage_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "not a recovery report directory" in capsys.readouterr().err


def test_a_missing_report_dir_says_it_is_missing(tmp_path, capsys):
    missing = tmp_path / "reports" / "2026-01-01T00-00"
    assert main(["report", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"hsx report: {missing}: no such directory" in err and "reports/<timestamp>" in err
    assert not missing.exists()


@pytest.mark.parametrize("host", ["node-1"])
def test_report_json_has_the_documented_shape(tmp_path, host):
    (tmp_path / "facts").mkdir()
    (tmp_path / "facts" / f"{host}.json").write_text(json.dumps(RECOVERED))
    build(tmp_path)
    data = json.loads((tmp_path / f"{host}.json").read_text())
    assert {"host", "ok", "checks", "before", "after"} <= data.keys()
    assert all({"name", "ok", "detail"} == set(c) for c in data["checks"])


def test_a_gpu_that_failed_the_health_gate_is_its_own_failed_check_with_the_findings():
    facts = json.loads(json.dumps(RECOVERED))
    facts["gpu_reclaim_health_result"] = {"passed": True, "findings": [], "msg": "8 GPUs healthy"}
    checks = {c["name"]: c for c in host_report(facts)["checks"]}
    assert checks["gpu health"] == {"name": "gpu health", "ok": True, "detail": "8 GPUs healthy"}
    facts["gpu_reclaim_health_result"] = {
        "passed": False, "msg": "GPU health gate failed: ...",
        "findings": [{"gpu": 3, "check": "ecc", "severity": "fail",
                      "message": "GPU 3: 2 uncorrectable ECC errors since the driver loaded"}]}
    r = host_report(facts)
    health = {c["name"]: c for c in r["checks"]}["gpu health"]
    assert not r["ok"] and not health["ok"]
    assert health["detail"] == "GPU 3: 2 uncorrectable ECC errors since the driver loaded"


def test_recover_against_an_unreachable_host_still_writes_summary_md(tmp_path):
    """README: every recovery writes reports/<timestamp>/summary.md; a host nobody can reach (a
    closed port on this machine: refused at once, no traffic beyond localhost) is in it."""
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(json.dumps({"extraction_nodes": {"hosts": {"gone-1": {
        "ansible_host": "127.0.0.1", "ansible_port": 1, "ansible_user": "root",
        "ansible_ssh_common_args": "-o ConnectTimeout=2"}}}}))
    reports = tmp_path / "reports"
    args = build_parser().parse_args(["recover", "-i", str(inventory), "--report-dir", str(reports)])
    shown = io.StringIO()
    assert run_playbook(args, "recover.yml", "recover", out=shown) == 1
    (summary,) = reports.glob("*/summary.md")
    text = summary.read_text()
    assert "0 of 1 hosts ok." in text and "gone-1" in text and "unreachable" in text, text
    assert f"Report: {summary.parent}" in shown.getvalue()
