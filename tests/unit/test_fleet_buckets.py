"""Issue #39 item 4: the whole dataset in one view (extraction/fleet/fleetbuckets.py), from what
each host's extraction_status (buckets=true) reads on its own disk and the assignment file."""

from __future__ import annotations

from promtool import promtool

from extraction.commands.fleet_status import exit_code
from extraction.fleet.fleetbuckets import fleet_view, prometheus_text, render_view
from extraction.fleet.fleetstatus import HostStatus

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
    assert exit_code(final, v) == 0  # c's stale "running" status does not count: it is retired
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
