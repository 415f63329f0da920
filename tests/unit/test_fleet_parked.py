"""Issue #51 item 7: `hsx fleet-status` records what each host that answers reports finished (beside the
assignment: .fleet/finished.json) and says which buckets are parked on a taken-over host that does not
answer, and why the fleet is not COMPLETE until they are read again or released (exit 1, a metric);
parked buckets are never counted done while their host does not answer, nor twice once it does.
"""

from __future__ import annotations

import argparse
import json

from promtool import promtool

from extraction.commands import fleet_status
from extraction.fleet.fleetbuckets import fleet_view, mark_taken_over, prometheus_text, render_view
from extraction.fleet.fleetstatus import HostStatus
from hsx.finishedrecord import read_record

TOTALS = [2, 2, 2, 2, 2, 2]
SINCE = "2026-12-07T11:00:00+00:00"
# c taken over while unreachable: 4 was reported finished on it (parked), 5 moved to b.
PARKED = {"buckets": 6, "created": "x", "epoch": 1, "hosts": {"a": "0-1", "b": "2-3,5", "c": "4"},
          "retired": ["c"], "history": [],
          "parked": {"c": {"buckets": "4", "since": SINCE, "reported_at": "2026-12-07T10:59:00+00:00",
                           "reported_by": "fleet-status"}}}


def host(name: str, assign: str, done: dict[int, int], state: str = "done") -> HostStatus:
    finished = ",".join(str(b) for b, c in sorted(done.items()) if c >= TOTALS[b])
    return HostStatus(name, result={
        "state": state, "making_progress": state == "running", "done": sum(done.values()), "total": 4,
        "bucket_count": 6, "bucket_totals": TOTALS, "assign": assign, "finished_buckets": finished,
        "bucket_done": {str(b): c for b, c in done.items()},
    })


LIVE = [host("a", "0-1", {0: 2, 1: 2}), host("b", "2-3,5", {2: 2, 3: 2, 5: 2})]


def test_parked_buckets_of_a_host_that_does_not_answer_keep_the_fleet_incomplete_saying_why() -> None:
    hosts = [*LIVE, HostStatus("c", unreachable=True, error="No route to host")]
    mark_taken_over(hosts, PARKED)
    v = fleet_view(hosts, PARKED)
    assert not v["complete"] and v["samples"]["missing"] == 2
    assert v["parked"] == {"c": {"buckets": "4", "count": 1, "since": SINCE, "answered": False,
                                 "reported_at": "2026-12-07T10:59:00+00:00", "reported_by": "fleet-status",
                                 "window_s": 86400}}  # the entry has none: the default
    lines = render_view(v)
    parked = [ln for ln in lines if ln.startswith("PARKED:")]
    assert parked and "bucket(s) 4 on c" in parked[0] and "hsx takeover c --disk-lost" in parked[0]
    assert lines[-1].endswith("INCOMPLETE (1 bucket(s) parked on a host not answering: see PARKED)")
    assert fleet_status.exit_code(hosts, v) == 1
    prom = prometheus_text(v, hosts)
    assert 'hsx_fleet_parked_buckets{host="c"} 1' in prom
    assert 'hsx_fleet_parked_since_timestamp_seconds{host="c"} 1796641200' in prom
    checked = promtool("check", "metrics", stdin=prom.encode())
    assert checked.returncode == 0 and not checked.stdout.strip() and not checked.stderr.strip(), checked
    assert "parked" in hosts[2].reason and "4" in hosts[2].reason


def test_once_its_host_answers_a_parked_bucket_counts_done_once() -> None:
    hosts = [*LIVE, host("c", "4-5", {4: 2, 5: 1}, "stopped")]
    mark_taken_over(hosts, PARKED)
    v = fleet_view(hosts, PARKED)
    assert v["complete"] and v["parked"] == {}
    assert v["samples"] == {"total": 12, "done": 12, "done_once": 11, "done_twice": 1, "missing": 0}
    assert not [ln for ln in render_view(v) if ln.startswith("PARKED:")]


def test_fleet_status_records_what_the_hosts_that_answer_finished(monkeypatch, tmp_path, capsys) -> None:
    path = tmp_path / ".fleet" / "assignment.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"buckets": 6, "hosts": {"a": "0-1", "b": "2-3", "c": "4-5"}, "epoch": 0,
                                "retired": []}))
    hosts = [host("a", "0-1", {0: 2, 1: 1}, "running"), host("b", "2-3", {}, "running"),
             HostStatus("c", unreachable=True, error="No route to host")]
    monkeypatch.setattr(fleet_status, "collect", lambda *a, **k: (hosts, None))
    parser = argparse.ArgumentParser()
    fleet_status.register(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["fleet-status", "--assignment", str(path), "--json"])
    assert fleet_status.once(args) == 1  # c unreachable, samples missing
    record = read_record(str(tmp_path / ".fleet" / "finished.json"), 6)
    assert {h: e["finished"] for h, e in record.items()} == {"a": {0}, "b": set()}  # c did not answer: not recorded
    assert record["a"]["by"] == "fleet-status"
    capsys.readouterr()
    # A record it cannot believe: said, naming it, and the exit is not 0 even where all else is fine.
    (tmp_path / ".fleet" / "finished.json").write_text("{broken")
    assert fleet_status.once(args) == 2
    err = capsys.readouterr().err
    assert "finished.json: not valid JSON" in err
