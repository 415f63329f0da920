"""The `hsx recover` event handler, fed real ansible-runner events recorded from lab runs.

tests/unit/data/runner_events_recover.json: `hsx recover` over 3 lab hosts planted with the
incident: -1 recovered, -2 without /data (fails at storage), -3 cut off (veth down) during
gpu_reclaim. tests/unit/data/runner_events_fleet_status.json: the ad-hoc extraction_status (now extraction_status_info) run
right after (-3 still cut off). Re-record: `python tests/unit/test_fleet_events.py OUT.json
reports/.runner/artifacts/<ident>...` (keeps only the fields the handlers read).
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from extraction.cli import main
from extraction.fleet.events import (
    FAILED,
    OK,
    UNREACHABLE,
    FleetProgress,
    LinePrinter,
    LiveTable,
    failure_message,
)
from extraction.fleet.playbook import cmdline_for, scrub_artifacts

DATA = Path(__file__).parent / "data"
KEEP_RES = ("msg", "changed", "censored", "rc", "failed", "unreachable", "skipped")


def recorded(name: str) -> list[dict]:
    return json.loads((DATA / name).read_text())["events"]


def recover_events() -> list[dict]:
    return recorded("runner_events_recover.json")


def three_hosts() -> list[str]:
    """The recording's hosts: recovered, without /data, cut off."""
    return sorted({e["event_data"].get("host") for e in recover_events()} - {None, "localhost"})


GOOD, NODATA, CUT = three_hosts() if (DATA / "runner_events_recover.json").exists() else ("", "", "")


def test_recorded_run_gives_each_host_its_verdict():
    progress = FleetProgress()
    lines = [line for e in recover_events() for line in progress.feed(e)]
    assert progress.finished
    assert progress.hosts[GOOD].outcome == OK
    assert progress.hosts[NODATA].outcome == FAILED
    assert progress.hosts[CUT].outcome == UNREACHABLE
    assert progress.any_bad()
    # Where and why, as soon as it happened (a line) and in the recap.
    nodata_fail = next(ln for ln in lines if ln.startswith(f"{NODATA}: FAILED at storage_guard"))
    assert "/data is not mounted" in nodata_fail
    assert any(ln.startswith(f"{CUT}: UNREACHABLE at gpu_reclaim") for ln in lines)
    recap = {ln.split()[0]: ln for ln in progress.recap_lines()}
    assert recap[GOOD].split()[1] == OK and "failed=0" in recap[GOOD]
    assert "at storage_guard : " in recap[NODATA] and "rescued=1" in recap[NODATA]
    assert recap[CUT].split()[1] == UNREACHABLE
    assert progress.report_dir and progress.report_dir.endswith("Z")


def test_stage_follows_the_role_of_the_running_task():
    progress = FleetProgress()
    stages = []
    for e in recover_events():
        progress.feed(e)
        h = progress.hosts.get(GOOD)
        if h and (not stages or stages[-1] != h.stage):
            stages.append(h.stage)
    roles = [
        s
        for s in stages
        if s
        in (
            "node_assess",
            "gpu_reclaim",
            "storage_guard",
            "shard_verify",
            "extraction_deploy",
            "extraction_job",
            "recover_report",
        )
    ]
    assert roles[:6] == [
        "node_assess",
        "gpu_reclaim",
        "storage_guard",
        "shard_verify",
        "extraction_deploy",
        "extraction_job",
    ], stages


def test_live_counts_agree_with_the_final_stats():
    progress = FleetProgress()
    events = recover_events()
    for e in events[:-1]:
        progress.feed(e)
    live = {n: (h.ok, h.changed) for n, h in progress.hosts.items()}
    assert progress.hosts[NODATA].outcome == FAILED  # known before the stats arrive
    progress.feed(events[-1])
    for name, h in progress.hosts.items():
        assert live[name] == (h.stats["ok"] + h.stats["ignored"], h.stats["changed"]) or live[name] == (
            h.stats["ok"],
            h.stats["changed"],
        ), (name, live[name], h.stats)


def test_line_printer_is_plain_and_the_live_table_redraws_in_place():
    plain = io.StringIO()
    printer = LinePrinter(FleetProgress(), plain)
    for e in recover_events():
        assert printer(e) is True  # events stay in the artifacts
    text = plain.getvalue()
    assert "\x1b" not in text and f"{NODATA}: FAILED at storage_guard" in text

    tty = io.StringIO()
    table = LiveTable(FleetProgress(), tty, title="hsx recover")
    table.MIN_INTERVAL_S = 0
    for e in recover_events():
        table(e)
    table.close()
    out = tty.getvalue()
    assert "\x1b[" in out and "F\x1b[J" in out  # cursor up + clear: redrawn, not appended
    last = out.rsplit("\x1b[J", 1)[1]
    assert f"{CUT}" in last and UNREACHABLE in last and FAILED in last
    assert out.count(f"{NODATA}: FAILED at storage_guard") == 1  # the failure scrolls once, above


def test_failure_message_variants():
    assert failure_message({"msg": "boom\n  again"}) == "boom again"
    assert failure_message({"stderr": "x\nlast line\n", "rc": 3}) == "last line"
    assert failure_message({"rc": 5}) == "rc=5"
    assert failure_message({"results": [{"failed": False}, {"failed": True, "msg": "item 2"}]}) == "item 2"
    censored = "the output has been hidden due to the fact that 'no_log: true' was specified for this result"
    assert failure_message({"censored": censored, "msg": "secret"}) == censored


def test_no_log_result_never_shows_its_message():
    progress = FleetProgress()
    progress.feed(
        {
            "event": "runner_on_failed",
            "event_data": {
                "host": "h",
                "task": "t",
                "role": "r",
                "res": {"censored": "hidden (no_log)", "changed": False},
            },
        }
    )
    assert progress.hosts["h"].failure.message == "hidden (no_log)"


def test_ignored_failures_do_not_fail_the_host():
    progress = FleetProgress()
    progress.feed(
        {
            "event": "runner_on_failed",
            "event_data": {"host": "h", "task": "probe", "ignore_errors": True, "res": {"msg": "nope"}},
        }
    )
    assert progress.hosts["h"].outcome == OK and progress.hosts["h"].failure is None


def test_artifacts_keep_no_environment_and_no_extra_vars(tmp_path):
    (tmp_path / "command").write_text(
        json.dumps(
            {
                "command": ["ansible-playbook", "-e", "token=s3cret", "--extra-vars", '{"k": 1}', "x.yml"],
                "cwd": "/repo",
                "env": {"AWS_SECRET_ACCESS_KEY": "s3cret"},
            }
        )
    )
    scrub_artifacts(tmp_path)
    text = (tmp_path / "command").read_text()
    assert "s3cret" not in text and "env" not in json.loads(text)
    assert json.loads(text)["command"] == [
        "ansible-playbook",
        "-e",
        "<hidden>",
        "--extra-vars",
        "<hidden>",
        "x.yml",
    ]


def test_cmdline_and_missing_playbook(tmp_path, capsys):
    import argparse

    args = argparse.Namespace(
        extra_vars=["a=1", f"@{tmp_path}/v.yml"], check=True, diff=False, skip_tags="x y"
    )
    assert cmdline_for(args) == f"-e a=1 -e @{tmp_path}/v.yml --check --skip-tags 'x y'"
    if not Path(__file__).resolve().parents[2].joinpath("playbooks", "rollout_patch.yml").exists():
        assert main(["rollout-patch"]) == 2
        assert "playbooks/rollout_patch.yml does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["recover", "--no-such-flag"])
    assert e.value.code == 2


def trim(event: dict) -> dict:
    """Only what the handlers read, so fixtures stay small and hold no host facts."""
    data = event.get("event_data") or {}
    keep = {k: data[k] for k in ("host", "task", "role", "play", "task_action", "ignore_errors") if k in data}
    if event.get("event") == "playbook_on_stats":
        keep.update(
            {
                k: data.get(k)
                for k in ("ok", "changed", "failures", "dark", "skipped", "rescued", "ignored", "processed")
            }
        )
    res = data.get("res")
    if isinstance(res, dict):
        small = {k: res[k] for k in KEEP_RES if k in res}
        if "stderr" in res:
            small["stderr"] = str(res["stderr"])[-300:]
        facts = res.get("ansible_facts") or {}
        if "recover_report_run_dir" in facts:
            small["ansible_facts"] = {"recover_report_run_dir": facts["recover_report_run_dir"]}
        if data.get("task_action") in ("extraction_status", "extraction_status_info"):  # recorded before and after the rename
            small.update({k: v for k, v in res.items() if k != "invocation"})
        if data.get("task_action", "").endswith("slurp"):
            small["content"] = res.get("content")
        keep["res"] = small
    return {"event": event.get("event"), "counter": event.get("counter"), "event_data": keep}


def record(out: str, *artifact_dirs: str) -> None:
    kept = []
    for artifact_dir in artifact_dirs:
        events = [json.loads(p.read_text()) for p in Path(artifact_dir, "job_events").glob("*.json")]
        events.sort(key=lambda e: e.get("counter", 0))
        kept += [trim(e) for e in events if e.get("event") != "verbose"]
    names = ", ".join(Path(d).name for d in artifact_dirs)
    Path(out).write_text(
        json.dumps({"recorded": f"runner artifacts {names}", "events": kept}, indent=1) + "\n"
    )


if __name__ == "__main__":
    record(sys.argv[1], *sys.argv[2:])
