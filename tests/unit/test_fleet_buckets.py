"""Issue #39 item 4: the whole dataset in one view (extraction/fleet/fleetbuckets.py), from what
each host's extraction_status (buckets=true) reads on its own disk and the assignment file."""

from __future__ import annotations

import io
import json

from promtool import promtool

from extraction.commands.fleet_status import exit_code
from extraction.fleet.fleetbuckets import fleet_view, mark_taken_over, prometheus_text, render_view
from extraction.fleet.fleetstatus import (
    STALLED,
    TAKEN_OVER,
    UNREACHABLE,
    HostStatus,
    as_json,
    fleet_total,
    render,
)

TOTALS = [2, 2, 2, 2, 2, 2]  # 6 buckets of 2 samples


def host(name: str, assign: str, done: dict[int, int], state: str = "running") -> HostStatus:
    return HostStatus(name, result={
        "state": state, "making_progress": state == "running", "done": sum(done.values()), "total": 4,
        "bucket_count": 6, "bucket_totals": TOTALS, "assign": assign,
        "bucket_done": {str(b): c for b, c in done.items()},
    })


def test_a_takeover_mid_run_then_complete_counts_duplicates_and_nothing_missing() -> None:
    assignment = {"buckets": 6, "hosts": {"a": "0-1", "b": "2-3", "c": "4-5"}, "retired": [], "epoch": 0}
    dead = HostStatus("c", unreachable=True, error="No route to host")
    hosts = [host("a", "0-1", {0: 2, 1: 1}), host("b", "2-3", {2: 2}), dead]
    v = fleet_view(hosts, assignment)
    assert v["bucket_states"] == {"done": 2, "running": 2, "unreachable": 2, "unassigned": 0}
    assert v["samples"] == {"total": 12, "done": 5, "done_once": 5, "done_twice": 0, "missing": 7}
    assert not v["complete"] and v["per_host"]["c"]["buckets"]["unreachable"] == 2
    assert exit_code(hosts, v) == 1
    # c taken over (4 -> a, 5 -> b); a's job has not got its new buckets yet: 4 is unassigned.
    after = {"buckets": 6, "hosts": {"a": "0-1,4", "b": "2-3,5", "c": ""}, "retired": ["c"], "epoch": 1}
    v = fleet_view([host("a", "0-1", {0: 2, 1: 2}), host("b", "2-3,5", {2: 2, 3: 2}), dead], after)
    assert v["bucket_states"] == {"done": 4, "running": 1, "unreachable": 0, "unassigned": 1}
    # Everything done; c is back with 1 sample of bucket 4 and 2 of bucket 5 (done before it died).
    back = host("c", "4-5", {4: 1, 5: 2})
    final = [host("a", "0-1,4", {0: 2, 1: 2, 4: 2}, "done"), host("b", "2-3,5", {2: 2, 3: 2, 5: 2}, "done"), back]
    v = fleet_view(final, after)
    assert v["complete"] and v["exact"] and v["bucket_states"]["done"] == 6
    assert v["samples"] == {"total": 12, "done": 12, "done_once": 9, "done_twice": 3, "missing": 0}
    assert v["per_host"]["c"] == {"buckets": dict.fromkeys(("done", "running", "unreachable", "unassigned"), 0),
                                  "owned": 0, "samples_done": 3, "samples_elsewhere": 3, "answered": True,
                                  "retired": True}
    assert exit_code(final, v) == 0
    lines = render_view(v)
    assert lines[-1].endswith("12/12 done (9 once, 3 twice), 0 missing: COMPLETE") and "(retired)" in lines[3]
    prom = prometheus_text(v)
    assert 'hsx_fleet_samples{kind="done_twice"} 3' in prom and "hsx_fleet_complete 1" in prom
    assert 'hsx_fleet_buckets{host="a",state="done"} 3' in prom
    checked = promtool("check", "metrics", stdin=prom.encode())
    assert checked.returncode == 0 and not checked.stdout.strip() and not checked.stderr.strip(), checked


def test_a_bucket_shared_mid_run_counts_missing_at_most_never_less() -> None:
    assignment = {"buckets": 6, "hosts": {"a": "0-5", "b": ""}, "retired": ["b"], "epoch": 1}
    v = fleet_view([host("a", "0-5", {0: 1}), host("b", "0", {0: 1})], assignment)
    assert not v["exact"] and v["samples"]["missing"] == 11  # the two may be one sample or two


def test_no_bucket_totals_counts_nothing_done() -> None:
    h = HostStatus("a", result={"state": "running", "bucket_count": 6, "bucket_totals": None, "assign": "0-5",
                                "bucket_done": {"0": 2}})
    v = fleet_view([h], None)
    assert not v["known"] and not v["complete"] and v["bucket_states"]["done"] == 0
    assert render_view({"known": False})[0].startswith("BUCKETS: unknown")


def table(hosts: list[HostStatus]) -> dict[str, str]:
    """fleetstatus.render's per-host table: host -> its line, and "FLEET" -> the total's line."""
    out = io.StringIO()
    render(hosts, out)
    lines = out.getvalue().splitlines()[1:]
    return {**{ln.split()[0]: ln for ln in lines[:-1]}, "FLEET": lines[-1]}


def test_a_host_taken_over_reads_as_such_never_as_an_alarm() -> None:
    """The per-host table, the total and the exit code: a retired host's stale job or its silence is
    no alarm; it reads TAKEN OVER with the buckets it kept. A host not retired keeps its marks."""
    after = {"buckets": 6, "hosts": {"a": "0-1,4", "b": "2-3,5", "c": "0-1"}, "retired": ["c"], "epoch": 1}
    a, b = host("a", "0-1,4", {0: 2, 1: 2, 4: 2}, "done"), host("b", "2-3,5", {2: 2, 3: 2, 5: 2}, "done")
    for c in (HostStatus("c", unreachable=True, error="No route to host"),  # still dead
              host("c", "0-1,4-5", {4: 1, 5: 2}, "stopping")):  # back, its status stale
        before = table([a, b, c])["c"]
        assert c.mark in (UNREACHABLE, STALLED) and c.mark in before  # without the assignment: an alarm
        mark_taken_over([a, b, c], after)
        assert c.mark == TAKEN_OVER and not c.alarm and c.taken_over == "0-1"
        rows = table([a, b, c])
        assert "TAKEN OVER: its unfinished buckets moved to other hosts; keeps its finished bucket(s) 0-1" in rows["c"]
        assert UNREACHABLE not in rows["c"] and STALLED not in rows["c"]
        assert rows["FLEET"].endswith("; 0 marked, 1 taken over")
        assert ("not reachable now" if c.unreachable else "its output holds 3 samples") in rows["c"]
        data = json.loads(as_json([a, b, c]))
        assert data["total"]["marked"] == {} and data["total"]["taken_over"] == ["c"]
        assert [h["taken_over"] for h in data["hosts"]] == [None, None, "0-1"]
        assert exit_code([a, b, c], fleet_view([a, b, c], after)) == 0
    # A host the file does not retire keeps its alarm, and the exit code says so.
    stalled = host("b", "2-3,5", {2: 2}, "stopping")
    mark_taken_over([a, stalled], after)
    assert stalled.mark == STALLED and fleet_total([a, stalled])["marked"] == {"b": STALLED}
    assert exit_code([a, stalled], fleet_view([a, stalled], after)) == 1


def test_a_host_with_no_run_or_an_unreadable_index_runs_nothing_and_counts_nothing() -> None:
    """A host whose job never wrote its buckets (no run yet) does not run its buckets: they are
    unassigned, not "running"; one whose index cannot be read (buckets_error) counts nothing done,
    whatever else it says."""
    assignment = {"buckets": 6, "hosts": {"a": "0-2", "b": "3-5"}, "retired": [], "epoch": 0}
    fresh = HostStatus("b", result={"state": "none", "bucket_count": None, "bucket_totals": None, "assign": None})
    v = fleet_view([host("a", "0-2", {0: 2, 1: 2, 2: 1}), fresh], assignment)
    assert v["per_host"]["b"]["buckets"] == {"done": 0, "running": 0, "unreachable": 0, "unassigned": 3}, v["per_host"]["b"]
    broken = HostStatus("b", result={"state": "running", "bucket_count": None, "buckets_error": "index: a FIFO",
                                     "bucket_totals": TOTALS, "assign": "3-5", "bucket_done": {"3": 2}})
    v = fleet_view([host("a", "0-2", {0: 2, 1: 2, 2: 2}), broken], assignment)
    assert v["bucket_states"]["done"] == 3 and v["samples"]["missing"] == 6 and not v["complete"]
    assert v["per_host"]["b"]["buckets"]["running"] == 0


def test_under_limit_the_dataset_view_is_not_claimed(monkeypatch, tmp_path, capsys) -> None:
    """`hsx fleet-status --limit a`: the hosts not asked are not counted as unreachable and their
    samples not as missing; the view says why it is not given and the exit code follows host a."""
    import argparse

    from extraction.commands import fleet_status

    assignment = tmp_path / "assignment.json"
    assignment.write_text(json.dumps({"buckets": 6, "hosts": {"a": "0-2", "b": "3-5"}, "epoch": 0, "retired": []}))
    monkeypatch.setattr(fleet_status, "collect", lambda *a, **k: ([host("a", "0-2", {0: 2, 1: 2, 2: 2})], None))
    parser = argparse.ArgumentParser()
    fleet_status.register(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["fleet-status", "--limit", "a", "--assignment", str(assignment), "--json"])
    assert fleet_status.once(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert "--limit" in json.dumps(out) and "missing" not in json.dumps(out.get("buckets", out))


def test_three_copies_of_a_sample_count_it_once_as_done_more_than_once() -> None:
    """Three hosts that each ran the whole dataset (no assignment file): every sample is done, each
    more than once; none is "done once", and no count goes negative."""
    whole = {b: 2 for b in range(6)}
    v = fleet_view([host(h, "0-5", whole) for h in ("a", "b", "c")], None)
    assert v["samples"] == {"total": 12, "done": 12, "done_once": 0, "done_twice": 12, "missing": 0}, v["samples"]
