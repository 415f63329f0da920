"""`hsx fleet-status` rows, marks and totals from recorded ad-hoc runner events; the plots."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest

from extraction.cli import main
from extraction.fleet.fleetstatus import (
    NO_JOB,
    STALLED,
    UNREACHABLE,
    HostStatus,
    StatusCollector,
    _history_from_slurp,
    as_json,
    fleet_total,
    render,
)
from hsx.status import StatusReporter

DATA = Path(__file__).parent / "data"


def collected() -> list[HostStatus]:
    c = StatusCollector()
    for e in json.loads((DATA / "runner_events_fleet_status.json").read_text())["events"]:
        assert c(e) is True
    return sorted(c.hosts.values(), key=lambda h: h.host)


def test_recorded_fleet_marks_unreachable_and_stalled_hosts_and_hides_none():
    hosts = collected()
    assert len(hosts) == 3
    good, nodata, cut = hosts
    assert cut.mark == UNREACHABLE and cut.error
    assert good.mark == "" and good.result["state"] in ("running", "done")
    assert nodata.mark in (STALLED, NO_JOB)
    total = fleet_total(hosts)
    assert total["hosts"] == 3 and set(total["marked"]) == {nodata.host, cut.host}
    assert total["done"] == good.result["done"] + nodata.result.get("done", 0)
    out = io.StringIO()
    render(hosts, out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 5 and lines[-1].startswith("FLEET: 3 hosts, done ")
    assert any(ln.startswith(cut.host) and UNREACHABLE in ln for ln in lines)
    data = json.loads(as_json(hosts))
    assert [h["host"] for h in data["hosts"]] == [h.host for h in hosts]


def _result(**kw) -> dict:
    base = {
        "state": "running",
        "done": 10,
        "total": 20,
        "samples_per_s": 2.0,
        "pid": 7,
        "pid_alive": True,
        "making_progress": True,
        "last_progress_age_s": 3.0,
        "eta_s": 5.0,
        "message": "",
    }
    return {**base, **kw}


def test_marks():
    assert HostStatus("a", _result()).mark == ""
    assert HostStatus("a", _result(state="done", making_progress=False)).mark == ""
    stalled = HostStatus("a", _result(making_progress=False, pid_alive=False))
    assert stalled.mark == STALLED and stalled.reason == "state running; pid 7 not running"
    assert HostStatus("a", _result(state="paused: disk low", making_progress=False)).mark == STALLED
    assert HostStatus("a", _result(state="none", making_progress=False)).mark == NO_JOB
    assert HostStatus("a", unreachable=True, error="ssh: timed out").mark == UNREACHABLE
    assert HostStatus("a", error="boom").mark == "MODULE FAILED"


def test_total_counts_only_progressing_rates():
    hosts = [
        HostStatus("a", _result()),
        HostStatus("b", _result(making_progress=False, samples_per_s=9.0)),
        HostStatus("c", unreachable=True, error="x"),
    ]
    t = fleet_total(hosts)
    assert (t["done"], t["total"], t["samples_per_s"], t["eta_s"]) == (20, 40, 2.0, 10.0)
    assert t["marked"] == {"b": STALLED, "c": UNREACHABLE}


def test_status_plot_draws_the_history(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "run"
    out.mkdir()
    r = StatusReporter(str(out), total=20, skipped_existing=0, reserve_bytes=0)
    r.set_state("running")
    for _ in range(3):
        r.add_written(5, 10)
        r.write()
    png = tmp_path / "p.png"
    assert main(["status", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "status.json").write_text(json.dumps({"state": "starting", "history": []}))
    assert main(["status", str(empty), "--plot", str(tmp_path / "q.png")]) == 2
    assert "no progress history" in capsys.readouterr().err


def test_fleet_plot_uses_the_slurped_histories(tmp_path):
    pytest.importorskip("matplotlib")
    from extraction.fleet.plot import plot_history

    hosts = collected()
    series = {h.host: h.history for h in hosts}
    assert any(series.values()), "the recording holds the slurped status.json histories"
    png = plot_history(series, tmp_path / "f.png", "fleet", {h.host: h.result.get("total") for h in hosts})
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "raw",
    [b"[1, 2]", b"[" * 100_000 + b"]" * 100_000, b'{"history": "x"}', b"\xff\xfe", b'{"history": [["a", 1]]}'],
    ids=["a-list", "nested-too-deeply", "history-not-a-list", "not-utf8", "history-bad-point"],
)
def test_a_slurped_status_that_is_not_a_status_gives_no_history_and_no_crash(raw: bytes) -> None:
    """status.json is data, not truth: what a host holds may be anything (issue #30)."""
    assert _history_from_slurp({"content": base64.b64encode(raw).decode()}) == []
    good = json.dumps({"history": [[1.5, 2]]}).encode()
    assert _history_from_slurp({"content": base64.b64encode(good).decode()}) == [[1.5, 2]]
