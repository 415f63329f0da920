"""Issue #51 item 5 (the audit's fleet-view defects) and item 7 (the views after a takeover):
`hsx fleet-status` never says COMPLETE on hosts whose copies of the dataset disagree, flags a
taken-over host whose job runs on (a healed partition), writes its Prometheus file with its mode
from the start, and its per-host total agrees with the dataset view once a retired host is back."""

from __future__ import annotations

import io
import json
import os
import stat

from promtool import promtool

from extraction.commands import fleet_status
from extraction.commands.fleet_status import exit_code, write_prom
from extraction.fleet.fleetbuckets import fleet_view, mark_taken_over, prometheus_text, render_view
from extraction.fleet.fleetstatus import RETIRED_RUNNING, TAKEN_OVER, HostStatus, fleet_total, render
from hsx.buckets import parse_assign

FULL = [2, 2, 2, 2, 2, 2]  # the whole dataset: 6 buckets of 2 samples


def host(name: str, assign: str, done: dict[int, int], totals: list[int] = FULL, state: str = "done",
         **more: object) -> HostStatus:
    mine = sum(totals[b] for b in parse_assign(assign, len(totals)))
    return HostStatus(name, result={
        "state": state, "making_progress": state == "running", "pid_alive": state == "running",
        "done": sum(done.values()), "total": mine, "bucket_count": len(totals), "bucket_totals": totals,
        "assign": assign, "bucket_done": {str(b): c for b, c in done.items()}, "dataset_hash": "d1", **more,
    })


def test_hosts_whose_copies_of_the_dataset_disagree_are_never_complete() -> None:
    """Host a's copy lacks a row of bucket 3 (it counts 1 sample there, b counts 2): a finished
    bucket 3 by its own count, so taking a's counts (the first host's) as the truth says COMPLETE
    while a sample of bucket 3 exists nowhere."""
    assignment = {"buckets": 6, "hosts": {"a": "3-5", "b": "0-2"}, "retired": [], "epoch": 0}
    short = [2, 2, 2, 1, 2, 2]
    a = host("a", "3-5", {3: 1, 4: 2, 5: 2}, short, dataset_hash="d0")
    b = host("b", "0-2", {0: 2, 1: 2, 2: 2})
    v = fleet_view([a, b], assignment)
    assert not v["complete"] and v["samples"]["missing"] == 1, v["samples"]
    assert v["inconsistent"] == {"hosts": ["a", "b"], "buckets": "3", "dataset_hashes": {"a": "d0", "b": "d1"},
                                 "bucket_counts": {}}
    assert exit_code([a, b], v) == 1
    last = render_view(v)[-1]
    assert last.endswith("INCOMPLETE (inconsistent: the hosts' copies of the dataset disagree)"), last
    said = "\n".join(render_view(v))
    assert "hosts a, b count bucket(s) 3 differently" in said and "dataset hash a d0, b d1" in said, said
    assert "hsx_fleet_consistent 0" in prometheus_text(v)
    # The same counts, another dataset file (its hash): inconsistent as well, though no count differs.
    a_same = host("a", "3-5", {3: 2, 4: 2, 5: 2}, dataset_hash="d0")
    v = fleet_view([a_same, b], assignment)
    assert not v["complete"] and v["inconsistent"]["buckets"] == "" and exit_code([a_same, b], v) == 1
    # A host that ran another bucket count is a disagreement too (never silently left out).
    other = HostStatus("a", result={**a_same.result, "bucket_count": 4, "bucket_totals": [3, 3, 3, 3],
                                    "dataset_hash": "d1", "bucket_done": {}})
    v = fleet_view([other, b], assignment)
    assert not v["complete"] and "a runs 4 buckets, the fleet 6" in "\n".join(render_view(v))
    # Agreeing copies: complete, consistent, the metric says so.
    a_ok = host("a", "3-5", {3: 2, 4: 2, 5: 2})
    v = fleet_view([a_ok, b], assignment)
    assert v["complete"] and v["inconsistent"] is None and exit_code([a_ok, b], v) == 0
    assert "hsx_fleet_consistent 1" in prometheus_text(v)


def test_a_retired_host_whose_job_runs_on_is_flagged() -> None:
    """A partition healed: c was taken over while up, and its job still runs (other hosts'
    buckets now). It must read as an alarm (exit 1, a line saying what to do, a metric), not as
    TAKEN OVER; a retired host whose status merely says "running" from before it died is not."""
    after = {"buckets": 6, "hosts": {"a": "0-1,4", "b": "2-3,5", "c": ""}, "retired": ["c"], "epoch": 1}
    a, b = host("a", "0-1,4", {0: 2, 1: 2, 4: 2}), host("b", "2-3,5", {2: 2, 3: 2, 5: 2})
    c = host("c", "4-5", {4: 2, 5: 1}, state="running", status_age_s=3.0, last_progress_age_s=4.0,
             samples_per_s=0.5)
    hosts = [a, b, c]
    mark_taken_over(hosts, after)
    assert c.mark == RETIRED_RUNNING and c.alarm
    v = fleet_view(hosts, after)
    assert v["complete"] and exit_code(hosts, v) == 1
    out = io.StringIO()
    render(hosts, out)
    row = next(ln for ln in out.getvalue().splitlines() if ln.startswith("c "))
    assert "taken over, yet its job runs" in row and "hsx takeover c" in row, row
    assert fleet_total(hosts)["marked"] == {"c": RETIRED_RUNNING}
    prom = prometheus_text(v, hosts)
    assert 'hsx_fleet_retired_running{host="c"} 1' in prom and 'hsx_fleet_retired{host="c"} 1' in prom
    checked = promtool("check", "metrics", stdin=prom.encode())
    assert checked.returncode == 0 and not checked.stdout.strip() and not checked.stderr.strip(), checked
    # Dead since the takeover: its status.json still says running, but no live process writes it.
    stale = host("c", "4-5", {4: 2, 5: 1}, state="running", pid_alive=False, making_progress=False,
                 status_age_s=900.0, last_progress_age_s=900.0)
    mark_taken_over([a, b, stale], after)
    assert stale.mark == TAKEN_OVER and exit_code([a, b, stale], fleet_view([a, b, stale], after)) == 0
    assert 'hsx_fleet_retired_running{host="c"} 0' in prometheus_text(v, [a, b, stale])


def test_the_per_host_total_agrees_with_the_dataset_once_a_retired_host_is_back() -> None:
    """Issue #51 item 7: `FLEET: done 688/782 (88.0%)` beside `600/600 ... COMPLETE`, the node shown
    running. The retired host's row and the total count only the buckets it kept; its stale
    "running" status does not make it look as if it ran."""
    after = {"buckets": 6, "hosts": {"a": "0-1,4", "b": "2-3,5", "c": ""}, "retired": ["c"], "epoch": 1}
    a, b = host("a", "0-1,4", {0: 2, 1: 2, 4: 2}), host("b", "2-3,5", {2: 2, 3: 2, 5: 2})
    back = host("c", "4-5", {4: 1, 5: 2}, state="running", pid_alive=False, making_progress=False,
                status_age_s=900.0)
    hosts = [a, b, back]
    mark_taken_over(hosts, after)
    view = fleet_view(hosts, after)
    assert view["complete"] and view["samples"]["total"] == 12
    out = io.StringIO()
    render(hosts, out)
    lines = out.getvalue().splitlines()
    assert lines[-1].startswith("FLEET: 3 hosts, done 12/12 (100.0%)"), lines[-1]
    row = next(ln for ln in lines if ln.startswith("c "))
    assert "running" not in row.split("TAKEN OVER")[0] and "retired" in row, row
    t = fleet_total(hosts)
    assert (t["done"], t["total"]) == (12, 12)


def test_the_prom_file_is_made_with_its_mode_never_chmodded_after_the_rename(tmp_path, monkeypatch) -> None:
    """node_exporter reads the file as another user: the temp is made 0644 (whatever the umask), so
    the name never points at a file it cannot read, not even between the rename and a chmod."""
    seen: list[int] = []
    real_replace, real_rename = os.replace, os.rename

    def spy(fn):
        def wrapped(src, dst, *a, **k):
            st = os.stat(src, dir_fd=k.get("src_dir_fd"))
            seen.append(stat.S_IMODE(st.st_mode))
            return fn(src, dst, *a, **k)
        return wrapped

    monkeypatch.setattr(os, "replace", spy(real_replace))
    monkeypatch.setattr(os, "rename", spy(real_rename))
    monkeypatch.setattr(fleet_status.os, "chmod", lambda *a, **k: (_ for _ in ()).throw(AssertionError("chmod")))
    old = os.umask(0o077)
    try:
        write_prom(str(tmp_path / "fleet.prom"), {"known": False})
    finally:
        os.umask(old)
    assert seen == [0o644]
    assert stat.S_IMODE((tmp_path / "fleet.prom").stat().st_mode) == 0o644
    assert "hsx_fleet_complete 0" in (tmp_path / "fleet.prom").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.prom"]


def test_json_names_the_disagreement() -> None:
    from extraction.fleet.fleetstatus import as_json

    assignment = {"buckets": 6, "hosts": {"a": "3-5", "b": "0-2"}, "retired": [], "epoch": 0}
    a = host("a", "3-5", {3: 1, 4: 2, 5: 2}, [2, 2, 2, 1, 2, 2])
    b = host("b", "0-2", {0: 2, 1: 2, 2: 2})
    data = json.loads(as_json([a, b], fleet_view([a, b], assignment)))
    assert data["dataset"]["inconsistent"]["buckets"] == "3" and not data["dataset"]["complete"]
