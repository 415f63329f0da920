"""The fast paths of verification that run in parallel, each reaching the same verdicts as one worker:
threads for `full`, forked workers for `quick` (the listing decides what is missing; chunks handed out
so a slow worker takes fewer; workers collected), the split by size, fork_map, the default worker
count (a core left for the listing; the affinity, not the host).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from shard_helpers import flip, make_run, manifest, tensors

import hsx.cores
import hsx.crc
import hsx.verify.check
import hsx.verify.full
import hsx.verify.pool
import hsx.verify.quick
import hsx.verify.quick_split
import hsx.ziprecords
from extraction.shards import ShardWriter
from hsx.cores import default_workers
from hsx.index import (
    append_index,
    index_record,
)
from hsx.layout import INDEX_NAME
from hsx.verify import verify_output
from hsx.verify.check import check_batch
from hsx.verify.pool import fork_map, reap
from hsx.verify.quick_split import split_by_size
from hsx.verify.quick_worker import QuickWorker


def _damage(tmp_path: Path, entries, every: int = 5) -> None:
    for e in entries[::every]:
        flip(tmp_path / e.path, 200)  # inside tensor data: passes quick, fails full


def test_full_uses_threads_for_big_shards_and_agrees_with_one_worker(tmp_path, monkeypatch):
    _, entries = make_run(tmp_path, n=24, length=4)
    _damage(tmp_path, entries)
    (tmp_path / entries[1].path).write_bytes(b"junk")
    one = verify_output(str(tmp_path), "full", workers=1)
    monkeypatch.setattr(hsx.ziprecords, "SMALL_FILE", 64)  # these shards now count as big: threads
    seen: set[str] = set()
    real = check_batch
    monkeypatch.setattr(hsx.verify.full, "check_batch", lambda *a: seen.add(threading.current_thread().name) or real(*a))
    two = verify_output(str(tmp_path), "full", workers=2)
    assert seen and all("ThreadPoolExecutor" in n for n in seen)
    assert [(b.path, b.reason) for b in one.bad] == [(b.path, b.reason) for b in two.bad]
    assert len(one.bad) == 6 and (one.checked, one.ok, one.bytes) == (two.checked, two.ok, two.bytes)


def test_quick_forks_workers_and_agrees_with_one(tmp_path, monkeypatch):
    w = ShardWriter(tmp_path, manifest())
    entries = [w.publish(f"s{i:03d}", **tensors(3 + i % 6, seed=i)) for i in range(30)]  # 6 sizes
    for e in entries[::4]:
        (tmp_path / e.path).write_bytes(b"PK junk")
    (tmp_path / entries[1].path).unlink()
    one = verify_output(str(tmp_path), "quick", workers=1)
    monkeypatch.setattr(hsx.verify.quick, "_FORK_MIN_QUICK", 1)
    monkeypatch.setattr(hsx.verify.quick_split, "_LIST_ALONGSIDE", True)  # whatever the number of cores here
    monkeypatch.setattr(hsx.verify.check, "_LAYOUTS", {})  # nothing learnt yet, as in a new `hsx verify`
    forks: list[int] = []
    real = fork_map
    monkeypatch.setattr(
        hsx.verify.quick_split, "fork_map", lambda fn, parts, *a: forks.append(len(parts)) or real(fn, parts, *a)
    )
    full_checks = tmp_path / "full-checks"  # appended to by every process (forked workers too)
    real_slow, real_learn = QuickWorker._slow, QuickWorker._learn

    def note(line: str) -> None:
        with open(full_checks, "a") as f:
            f.write(line + "\n")

    def slow(self, rel, row):
        note(f"slow {rel}")
        return real_slow(self, rel, row)

    def learn(self, data, row, size):
        passed = real_learn(self, data, row, size)
        note(f"learn-{'passed' if passed else 'failed'} {row[1]}")
        return passed

    monkeypatch.setattr(QuickWorker, "_slow", slow)
    monkeypatch.setattr(QuickWorker, "_learn", learn)
    three = verify_output(str(tmp_path), "quick", workers=3)
    assert forks == [4]  # the listing here, 3 workers checking what the index names
    assert [(b.path, b.reason) for b in one.bad] == [(b.path, b.reason) for b in three.bad]
    assert one.missing == three.missing == [entries[1].sample_id]
    assert (one.checked, one.ok, one.bytes, len(one.bad)) == (three.checked, three.ok, three.bytes, 8)
    # Split by size: each size's layout is learnt by one worker, from one good shard; the 8 bad
    # shards get the full check for their reasons, and so does the missing one (a worker cannot
    # open it; the listing then says it is missing), no other shard.
    calls = [line.split() for line in full_checks.read_text().splitlines()]
    learnt = [path for what, path in calls if what == "learn-passed"]
    assert len(learnt) == len(set(learnt)) == 6
    slow = sorted(path for what, path in calls if what == "slow")
    assert slow == sorted([b.path for b in one.bad] + [entries[1].path])


@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_forked_quick_lets_the_listing_decide_what_is_missing_irregular_or_unindexed(
    tmp_path, monkeypatch, delay
):
    """Workers check what the index names while this process lists the folders; the listing has
    the last word. A shard gone before the listing (after a worker passed it: delay 0.3 s; or
    before the worker opened it: 0) is missing, not ok and not bad; a FIFO in a shard's place and
    shards the index does not name get the full check (forked too when there are many)."""
    w = ShardWriter(tmp_path, manifest())
    entries = [w.publish(f"s{i:03d}", **tensors(3 + i % 4, seed=i)) for i in range(12)]  # 4 sizes
    extra = [w.publish(f"u{i}", **tensors(4, seed=i)) for i in range(3)]
    index = tmp_path / INDEX_NAME
    index.write_bytes(
        b"".join(line for line in index.read_bytes().splitlines(keepends=True) if b'"u' not in line)
    )
    os.unlink(tmp_path / entries[5].path)
    os.mkfifo(tmp_path / entries[5].path)  # listed, not a regular file
    one = verify_output(str(tmp_path), "quick", workers=1)
    monkeypatch.setattr(hsx.verify.quick, "_FORK_MIN_QUICK", 1)
    monkeypatch.setattr(hsx.verify.quick_split, "_FORK_MIN_REDO", 2)
    monkeypatch.setattr(hsx.verify.quick_split, "_LIST_ALONGSIDE", True)
    forks: list[int] = []
    real_fork = fork_map
    monkeypatch.setattr(
        hsx.verify.quick_split, "fork_map", lambda fn, parts, *a: forks.append(len(parts)) or real_fork(fn, parts, *a)
    )
    real_list = QuickWorker.list

    def list_after_a_deletion(self, take, fds, opened=None):
        time.sleep(delay)
        if opened is not None and (tmp_path / entries[2].path).exists():
            os.unlink(tmp_path / entries[2].path)
        return real_list(self, take, fds, opened)

    monkeypatch.setattr(QuickWorker, "list", list_after_a_deletion)
    r = verify_output(str(tmp_path), "quick", workers=3)
    assert forks[0] == 4 and len(forks) == 2  # listing + 3 workers; then the 4 full checks, forked
    assert r.missing == [entries[2].sample_id]
    assert r.unindexed == sorted(e.path for e in extra) == one.unindexed
    assert [(b.path, b.reason) for b in r.bad] == [(b.path, b.reason) for b in one.bad]
    assert [b.path for b in r.bad] == [entries[5].path] and "regular" in r.bad[0].reason
    assert r.ok == one.ok - 1 == 10 + 3  # 12 indexed - FIFO - gone, + 3 unindexed good shards
    assert r.bytes == one.bytes - entries[2].size
    assert r.checked == one.checked - 1


@pytest.mark.parametrize("alongside", [False, True])
def test_forked_quick_hands_out_chunks_so_a_slow_worker_takes_fewer(tmp_path, monkeypatch, alongside):
    """Chunks of sizes go out one at a time: the parent, slowed down here, checks fewer of them
    than its forked worker instead of half; the verdicts are one worker's."""
    w = ShardWriter(tmp_path, manifest())
    for i in range(24):
        w.publish(f"s{i:03d}", **tensors(3 + i % 8, seed=i))  # 8 sizes: 8 chunks for 2 workers
    one = verify_output(str(tmp_path), "quick", workers=1)
    monkeypatch.setattr(hsx.verify.quick, "_FORK_MIN_QUICK", 1)
    monkeypatch.setattr(hsx.verify.quick_split, "_LIST_ALONGSIDE", alongside)
    parent, log = os.getpid(), tmp_path / "chunks"
    real_check = QuickWorker.check

    def check(self, jobs, progress):
        if os.getpid() == parent:
            time.sleep(0.3)
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real_check(self, jobs, progress)

    monkeypatch.setattr(QuickWorker, "check", check)
    r = verify_output(str(tmp_path), "quick", workers=2)
    assert (r.checked, r.ok, r.bytes) == (one.checked, one.ok, one.bytes) == (24, 24, one.bytes)
    takers = log.read_text().split()
    assert len(takers) == 8
    assert takers.count(str(parent)) <= 2  # a static split would have given it half (4)


def test_forked_quick_agrees_with_one_worker_on_big_shards_and_made_up_index_paths(tmp_path, monkeypatch):
    """Shards over 1 MiB (a quick pass counts no bytes for them), an indexed copy under a dot-name
    (which the listing never shows: missing), index paths with a NUL or a lone surrogate (no such
    file can exist): workers opening what the index names agree with one worker, and do not fail."""
    w = ShardWriter(tmp_path, manifest())
    entries = [w.publish(f"s{i}", **tensors(20_000 + i, seed=i)) for i in range(6)]
    assert all(e.size > hsx.ziprecords.SMALL_FILE for e in entries)
    dot = "shards/" + entries[0].path.split("/")[1] + "/.hidden.pt"
    (tmp_path / dot).write_bytes((tmp_path / entries[0].path).read_bytes())
    made_up = [
        {**index_record(entries[0]), "id": "dot", "path": dot},
        {**index_record(entries[1]), "id": "nul", "path": entries[1].path[:10] + "a\0b.pt"},
        {**index_record(entries[2]), "id": "surrogate", "path": entries[2].path[:10] + "a\ud800.pt"},
    ]
    append_index(str(tmp_path), made_up)
    one = verify_output(str(tmp_path), "quick", workers=1)
    monkeypatch.setattr(hsx.verify.quick, "_FORK_MIN_QUICK", 1)
    monkeypatch.setattr(hsx.verify.quick_split, "_LIST_ALONGSIDE", True)
    three = verify_output(str(tmp_path), "quick", workers=3)
    for r in (one, three):
        # issue #30 item 4: none of these is its sample's own shard path, so each is reported
        # (and never opened), where before the listing called them missing
        assert (r.checked, r.ok, r.missing) == (6, 6, []), r.to_dict()
        assert [(b.sample_id, b.reason.endswith("(not touched)")) for b in r.bad] == [
            ("dot", True),
            ("nul", True),
            ("surrogate", True),
        ]
    assert (one.bytes, one.bad, one.unindexed, one.orphans) == (
        three.bytes,
        three.bad,
        three.unindexed,
        three.orphans,
    )


def test_split_by_size_keeps_each_size_in_one_share_and_balances():
    sizes = [100] * 40 + [104] * 3 + [108] * 1 + [112] * 40 + [116] * 2 + [120] * 30
    jobs = [(size, f"f{i}", None, f"r{i}", None, True) for i, size in enumerate(sorted(sizes))]
    shares = split_by_size(jobs, 3)
    assert len(shares) == 3 and [j for s in shares for j in s] == jobs  # every job once, in order
    owners = {}
    for k, share in enumerate(shares):
        for job in share:
            assert owners.setdefault(job[0], k) == k, f"size {job[0]} in shares {owners[job[0]]} and {k}"
    assert all(20 <= len(s) <= 60 for s in shares), [len(s) for s in shares]
    # No fast path (size 0: real, large shards): every job a full check, cut anywhere, evenly.
    slow = [(0, f"f{i}", None, f"r{i}", None, True) for i in range(100)]
    assert [len(s) for s in split_by_size(slow, 4)] == [25, 25, 25, 25]
    assert [len(s) for s in split_by_size(jobs[:2], 4)] == [2, 0, 0, 0]


def _pid(x: int) -> tuple[int, int]:
    return x, os.getpid()


def _fail_in_child(parent: int) -> int:
    if os.getpid() != parent:
        raise ValueError("boom")
    return 1


def _die_in_child(parent: int) -> int:
    if os.getpid() != parent:
        os._exit(3)
    return 1


def test_fork_map_runs_parts_in_children_and_reports_their_failures():
    out = fork_map(_pid, [(0,), (1,), (2,)])
    assert [x for x, _ in out] == [0, 1, 2]
    assert out[0][1] == os.getpid() and len({p for _, p in out}) == 3
    with pytest.raises(RuntimeError, match="boom"):
        fork_map(_fail_in_child, [(os.getpid(),), (os.getpid(),)])
    with pytest.raises(RuntimeError, match="died"):
        fork_map(_die_in_child, [(os.getpid(),), (os.getpid(),)])


def test_forked_quick_workers_are_collected(tmp_path, monkeypatch):
    monkeypatch.setattr(hsx.verify.quick, "_FORK_MIN_QUICK", 1)
    make_run(tmp_path, n=8)
    for _ in range(3):
        assert verify_output(str(tmp_path), "quick", workers=3).ok == 8
    for _ in range(100):
        reap([])
        if not hsx.verify.pool._EXITING:
            break
        time.sleep(0.05)
    assert hsx.verify.pool._EXITING == []


@pytest.mark.parametrize("cpus,workers", [(1, 1), (2, 2), (4, 3), (16, 15), (17, 16), (128, 16)])
def test_default_workers_leave_a_core_for_the_listing(monkeypatch, cpus, workers):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cpus)))
    assert default_workers() == workers


def test_usable_cores_are_the_affinity_not_the_host(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {3, 5, 7})  # taskset -c 3,5,7
    assert hsx.cores.usable_cores() == 3 and default_workers() == 2
    monkeypatch.delattr(os, "sched_getaffinity")  # not on Linux
    assert hsx.cores.usable_cores() == 64
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert hsx.cores.usable_cores() == 1
