"""The fast paths of verification: each must reach the same verdicts as the plain path.

Optional CRC32 libraries (checked against zlib before use), threads for `full`, forked
workers for `quick`, the layout memo's compared regions, the index's one-comparison line
check and the single directory pass for shards and orphan temps.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import types
import zlib
from pathlib import Path

import pytest
from shard_helpers import expect, flip, make_run, manifest, tensors

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
from hsx.crc import crc32_combine, use_crc_backend
from hsx.errors import ShardBad
from hsx.fsutil import find_orphan_temps
from hsx.index import (
    IndexEntry,
    append_index,
    checksum_string,
    encode_index_line,
    index_record,
    index_rows,
    load_index,
    read_index,
    tombstone_record,
)
from hsx.layout import INDEX_NAME, SHARDS_DIR, temp_name
from hsx.verify import verify_output
from hsx.verify.check import check_batch, check_shard
from hsx.verify.pool import fork_map, reap
from hsx.verify.quick_split import split_by_size
from hsx.verify.quick_worker import QuickWorker
from hsx.verify.scan import list_shards, scan_shards
from hsx.ziprecords import ShardReader, ZipRecord, read_zip_records


@pytest.fixture(autouse=True)
def _stdlib_crc_after():
    yield
    use_crc_backend("auto")


def _fake_lib(monkeypatch, name: str, crc32, combine=None) -> None:
    """Install a fake `isal.isal_zlib` / `zlib_ng.zlib_ng` module for _crc_backend to find."""
    pkg, mod = name.split(".")
    lib = types.ModuleType(name)
    lib.crc32 = crc32
    if combine is not None:
        lib.crc32_combine = combine
    monkeypatch.setitem(sys.modules, pkg, types.ModuleType(pkg))
    monkeypatch.setitem(sys.modules, name, lib)


def _counting_crc(calls: list[int]):
    def crc32(data, value=0):
        calls.append(len(data))
        return zlib.crc32(data, value)

    return crc32


def test_a_crc_library_that_agrees_with_zlib_is_used_for_full(tmp_path, monkeypatch):
    calls: list[int] = []
    _fake_lib(monkeypatch, "zlib_ng.zlib_ng", _counting_crc(calls))
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)  # not installed
    assert use_crc_backend("auto") == "zlib-ng"
    _, (entry,) = make_run(tmp_path, n=1, length=7)
    path = tmp_path / entry.path
    calls.clear()
    check_shard(str(path), expect(), "full", entry)
    assert calls, "full did not use the selected CRC32"
    flip(path, path.stat().st_size // 2)
    with pytest.raises(ShardBad):
        check_shard(str(path), expect(), "full", entry)


@pytest.mark.parametrize(
    "crc32, combine",
    [
        (lambda data, value=0: zlib.crc32(data, value) ^ 1, None),  # wrong values
        (lambda data, value=0: zlib.crc32(data), None),  # ignores the start value
        (lambda data, value=0: zlib.crc32(bytes(data), value), lambda a, b, n: a ^ b),  # wrong combine
        (lambda data, value=0: 1 / 0, None),  # raises
    ],
)
def test_a_crc_library_that_disagrees_with_zlib_is_never_used(monkeypatch, crc32, combine):
    _fake_lib(monkeypatch, "isal.isal_zlib", crc32, combine)
    monkeypatch.setitem(sys.modules, "zlib_ng.zlib_ng", None)
    assert use_crc_backend("auto") == "zlib"
    assert hsx.crc._crc32 is zlib.crc32


def test_hsx_crc32_env_forces_the_stdlib(monkeypatch):
    _fake_lib(monkeypatch, "isal.isal_zlib", zlib.crc32)
    monkeypatch.setenv("HSX_CRC32", "zlib")
    assert hsx.crc._crc_backend()[0] == "zlib"
    monkeypatch.setenv("HSX_CRC32", "isal")
    assert hsx.crc._crc_backend()[0] == "isal"


@pytest.mark.parametrize("backend", ["zlib", "isal", "zlib-ng"])
def test_real_backends_catch_every_record_flip_in_chunked_reads(tmp_path, monkeypatch, backend):
    if use_crc_backend(backend) != backend:
        pytest.skip(f"{backend} is not installed here")
    _, (entry,) = make_run(tmp_path, n=1, length=9)
    path = tmp_path / entry.path
    monkeypatch.setattr(hsx.ziprecords, "SMALL_FILE", 0)  # the pread + combine path, chunk edges inside records
    monkeypatch.setattr(hsx.crc, "_DIRECT_CRC_MAX", 0)
    monkeypatch.setattr(hsx.crc, "_CHUNK", 101)
    monkeypatch.setattr(hsx.crc, "_tls", threading.local())
    check_shard(str(path), expect(), "full", entry)
    data = path.read_bytes()
    with open(path, "r+b") as f:
        for off in range(0, len(data), 37):
            os.pwrite(f.fileno(), bytes([data[off] ^ 0x04]), off)
            with pytest.raises(ShardBad):
                check_shard(str(path), expect(), "full", entry)
            os.pwrite(f.fileno(), data[off : off + 1], off)


def test_crc32_combine_repeats_a_length_from_its_cache():
    a, b, c = os.urandom(100), os.urandom(4099), os.urandom(4099)
    first = crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b))
    assert 4099 in hsx.crc._SHIFT_OPS
    assert crc32_combine(first, zlib.crc32(c), len(c)) == zlib.crc32(a + b + c)


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


def _records(path: Path) -> dict[str, ZipRecord]:
    fd = os.open(path, os.O_RDONLY)
    try:
        recs = read_zip_records(ShardReader(fd, os.fstat(fd).st_size))[0]
    finally:
        os.close(fd)
    return {r.name.split("/", 1)[1]: r for r in recs}


def test_layout_memo_ignores_only_varying_bytes(tmp_path, monkeypatch):
    _, (a, b) = make_run(tmp_path, n=2, length=6)
    pa, pb = tmp_path / a.path, tmp_path / b.path
    calls = []
    real = hsx.verify.check._inspect
    monkeypatch.setattr(hsx.verify.check, "_inspect", lambda r, e: calls.append(1) or real(r, e))
    monkeypatch.setattr(hsx.verify.check, "_LAYOUTS", {})
    check_shard(str(pa), expect())
    check_shard(str(pb), expect())
    assert len(calls) == 1  # b matched a's layout: not parsed
    recs = _records(pb)
    data = pb.read_bytes()

    def parsed_after(offset: int, value: bytes) -> int:
        before = len(calls)
        pb.write_bytes(data[:offset] + value + data[offset + len(value) :])
        try:
            check_shard(str(pb), expect())
        except ShardBad:
            pass
        return len(calls) - before

    # Varying bytes: tensor data, its data descriptor, its CRC in the central directory.
    d0 = recs["data/0"]
    assert parsed_after(d0.data_offset, bytes([data[d0.data_offset] ^ 1])) == 0
    assert parsed_after(d0.data_offset + d0.size + 4, b"\xff") == 0
    assert parsed_after(d0.crc_at, b"\xff\xff\xff\xff") == 0
    # Everything else is compared: a change there means a full parse.
    ver = recs[".format_version"]
    for offset in (
        recs["data/0"].header_offset + 2,  # a local header
        recs["data.pkl"].data_offset + 5,  # the pickle
        ver.data_offset,  # a constant record's data
        ver.data_offset + ver.size + 4,  # a constant record's descriptor
        ver.crc_at,  # a constant record's CRC
        d0.crc_at + 4,  # the field after a varying CRC (compressed size)
        len(data) - 3,  # the end record
    ):
        assert parsed_after(offset, bytes([data[offset] ^ 0x20])) == 1, offset


def test_index_lines_not_written_by_us_still_follow_the_line_rule(tmp_path):
    e = IndexEntry("a", "shards/00/a.pt", 10, "crc32:00000001", 3)
    line = encode_index_line(index_record(e))
    upper = line[:-9] + line[-9:-1].upper() + b"\n"  # a valid CRC in capitals: accepted as before
    wrong = line[:-2] + (b"0" if line[-2:-1] != b"0" else b"1") + b"\n"
    (tmp_path / INDEX_NAME).write_bytes(upper + wrong + line)
    state = read_index(str(tmp_path))
    assert state.entries == {"a": e} and state.bad_lines == 1
    (tmp_path / INDEX_NAME).write_bytes(upper)
    assert read_index(str(tmp_path)).entries == {"a": e}
    (tmp_path / INDEX_NAME).write_bytes(b"\t00000000\n" + line)  # an empty body with its CRC
    state = read_index(str(tmp_path))
    assert state.entries == {"a": e} and state.bad_lines == 1


def test_one_directory_pass_finds_the_same_orphans(tmp_path):
    _, entries = make_run(tmp_path, n=3)
    bucket = (tmp_path / entries[0].path).parent
    for p in (
        tmp_path / temp_name("run.json"),
        tmp_path / SHARDS_DIR / temp_name("x.pt"),
        bucket / temp_name("y.pt"),
    ):
        p.write_bytes(b"partial")
    os.mkdir(bucket / temp_name("dir.pt"))  # not a file: not an orphan
    orphans: list[str] = []
    shards = list_shards(str(tmp_path), orphans)
    assert shards == scan_shards(str(tmp_path)) and len(shards) == 3
    assert orphans == find_orphan_temps(str(tmp_path)) and len(orphans) == 3
    assert verify_output(str(tmp_path)).orphans == orphans


def _plain_reasons(root: Path, entries) -> dict[str, str | None]:
    """check_shard's own verdict on every indexed path (the plain path quick must agree with)."""
    out: dict[str, str | None] = {}
    for e in entries:
        try:
            check_shard(str(root / e.path), expect(), "quick", e)
            out[e.path] = None
        except ShardBad as err:
            out[e.path] = str(err)
    return out


@pytest.mark.parametrize("workers,alongside", [(1, None), (2, False), (2, True)])
def test_quick_fast_path_sends_odd_files_to_the_plain_checks(tmp_path, monkeypatch, workers, alongside):
    # Shards of one length: after one run every size has a known layout, so each file below
    # reaches the 3-system-call path and must still be judged exactly as check_shard judges it.
    # With workers, the folders listed before the checks or alongside them (_quick_split).
    monkeypatch.setattr(hsx.verify.quick, "_FORK_MIN_QUICK", 1)
    monkeypatch.setattr(hsx.verify.quick_split, "_LIST_ALONGSIDE", alongside)
    _, entries = make_run(tmp_path, n=12, length=4)
    assert verify_output(str(tmp_path), "quick", workers=workers).ok == 12
    p = [tmp_path / e.path for e in entries]
    data = p[0].read_bytes()
    p[0].unlink()
    os.mkfifo(p[0])  # a FIFO: must not block
    p[1].unlink()
    p[1].mkdir()  # a directory
    target = tmp_path / "elsewhere.pt"
    target.write_bytes(data)
    p[2].unlink()
    p[2].symlink_to(target)  # a symlink to a good shard
    p[3].write_bytes(p[3].read_bytes() + b"\0")  # one byte more than the index says
    p[4].write_bytes(p[4].read_bytes()[:-1])  # one byte less
    append_index(str(tmp_path), [{**index_record(entries[5]), "size": entries[5].size + 1}])
    append_index(str(tmp_path), [{**index_record(entries[6]), "num_tokens": 9}])
    p[7].write_bytes(data)  # another sample's bytes: same size and layout, right tokens: passes
    flip(p[8], 40)  # inside the pickle
    entries = list(load_index(str(tmp_path)).values())
    plain = _plain_reasons(tmp_path, entries)
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("quick blocked on a file"))
    signal.alarm(20)
    try:
        r = verify_output(str(tmp_path), "quick", workers=workers)
    finally:
        signal.alarm(0)
    assert {b.path: b.reason for b in r.bad} == {k: v for k, v in plain.items() if v is not None}
    reasons = {b.path: b.reason for b in r.bad}
    assert reasons[entries[0].path] == reasons[entries[1].path] == "not a regular file"
    assert reasons[entries[2].path].startswith("a symlink")
    assert "differs from the index" in reasons[entries[5].path]
    assert "the index says 9" in reasons[entries[6].path]
    assert len(r.bad) == 8 and r.ok == 4 and r.checked == 12 and not r.errors and not r.missing


def test_quick_reads_known_small_shards_without_the_plain_checks(tmp_path, monkeypatch):
    _, entries = make_run(tmp_path, n=20, length=5)
    verify_output(str(tmp_path), "quick")  # learns the layout
    calls: list[str] = []
    real = check_shard
    monkeypatch.setattr(hsx.verify.check, "check_shard", lambda path, *a, **k: calls.append(path) or real(path, *a, **k))
    r = verify_output(str(tmp_path), "quick")
    assert r.ok == 20 and r.bytes == sum(e.size for e in entries) and calls == []
    (tmp_path / entries[3].path).write_bytes(b"PK junk")
    r = verify_output(str(tmp_path), "quick")
    assert calls == [str(tmp_path / entries[3].path)] and r.ok == 19


def test_quick_keeps_two_layouts_of_one_size_on_the_fast_path(tmp_path, monkeypatch):
    """Shards of one size whose records are named differently (torch.save by path names them after
    the file): both layouts are learnt, and shards of either pass without the plain checks."""
    import torch

    _, entries = make_run(tmp_path, n=8, length=5)
    records = []
    for e in entries[::2]:  # every other one re-saved by path under a 7-letter name (as long as "archive")
        alt = tmp_path / "abcdefg.pt"
        torch.save(torch.load(tmp_path / e.path, weights_only=True), alt)
        data = alt.read_bytes()
        assert len(data) == e.size and b"abcdefg/data.pkl" in data
        os.replace(alt, tmp_path / e.path)
        crc = checksum_string(zlib.crc32(data))
        records.append(index_record(IndexEntry(e.sample_id, e.path, e.size, crc, e.num_tokens)))
    append_index(str(tmp_path), records)
    monkeypatch.setattr(hsx.verify.check, "_LAYOUTS", {})
    assert verify_output(str(tmp_path), "full").ok == 8
    verify_output(str(tmp_path), "quick")  # learns both
    e = expect()
    assert len(hsx.verify.check._LAYOUTS[(entries[0].size, e.hidden_size, e.num_aux, e.dtype)]) == 2
    calls: list[str] = []
    real = check_shard
    monkeypatch.setattr(hsx.verify.check, "check_shard", lambda path, *a, **k: calls.append(path) or real(path, *a, **k))
    r = verify_output(str(tmp_path), "quick")
    assert r.ok == 8 and calls == []


def _rows_of(root: Path) -> dict[str, tuple]:
    return {
        e.sample_id: (e.sample_id, e.path, e.size, e.checksum, e.num_tokens)
        + ((e.fingerprint,) if e.fingerprint is not None else ())
        for e in read_index(str(root)).entries.values()
    }


def test_index_rows_take_only_lines_written_by_us_and_agree_with_read_index(tmp_path):
    _, entries = make_run(tmp_path, n=5)
    index = tmp_path / INDEX_NAME
    good = index.read_bytes()
    lines = good.splitlines(keepends=True)
    assert index_rows(lines) == _rows_of(tmp_path) and len(_rows_of(tmp_path)) == 5
    e = entries[0]
    odd = [
        encode_index_line(tombstone_record(e.sample_id, "bad")),  # a tombstone
        encode_index_line({**index_record(e), "size": str(e.size)}),  # converted by read_index
        encode_index_line({**index_record(e), "size": True}),
        encode_index_line({**index_record(e), "removed": False}),  # another key
        encode_index_line({**index_record(e), "path": 7}),
        encode_index_line({**index_record(e), "run_fp": 7}),  # a fingerprint that is no string
        encode_index_line({k: v for k, v in index_record(e).items() if k != "run_fp"}),  # old and new
        lines[0][:-9] + lines[0][-9:-1].upper() + b"\n",  # a valid CRC in capitals
        lines[0][:-2] + b"x\n",  # a damaged line
        lines[0][:-1],  # a torn tail
        b"[1]\t" + b"%08x" % zlib.crc32(b"[1]") + b"\n",  # not an object
    ]
    for extra in odd:
        index.write_bytes(good + extra)
        assert index_rows((good + extra).splitlines(keepends=True)) is None, extra
        # verify_output then replays the index line by line, as read_index does
        r = verify_output(str(tmp_path), "quick")
        state = read_index(str(tmp_path))
        assert r.index_bad_lines == state.bad_lines
        assert r.checked == 5 and len(r.missing) + r.ok + len(r.bad) >= 5
    index.write_bytes(good + encode_index_line({**index_record(e), "sample": 1}))
    assert index_rows(index.read_bytes().splitlines(keepends=True)) is None


def test_index_rows_later_lines_win_and_paths_outside_go_the_plain_way(tmp_path):
    _, entries = make_run(tmp_path, n=3)
    e = entries[1]
    append_index(str(tmp_path), [{**index_record(e), "num_tokens": 42}])
    lines = (tmp_path / INDEX_NAME).read_bytes().splitlines(keepends=True)
    assert index_rows(lines) == _rows_of(tmp_path) and _rows_of(tmp_path)[e.sample_id][4] == 42
    r = verify_output(str(tmp_path), "quick")
    assert [b.reason for b in r.bad] == [f"{e.num_tokens} tokens, the index says 42"]
    append_index(str(tmp_path), [{**index_record(entries[0]), "id": "a-twin"}])  # one path, two ids
    lines = (tmp_path / INDEX_NAME).read_bytes().splitlines(keepends=True)
    assert index_rows(lines) == _rows_of(tmp_path)
    (tmp_path / entries[0].path).write_bytes(b"junk")
    r = verify_output(str(tmp_path), "quick")
    # issue #30 item 4: two entries naming one shard are both reported, with both ids, and the
    # shard they name is then an unindexed file with a verdict of its own (before: the later id in
    # sorted order owned the path, and the other entry's lost shard went unseen)
    bad = sorted((b.sample_id or "", b.path) for b in r.bad)
    path0 = entries[0].path
    assert bad == [("", path0), ("a-twin", path0), (entries[0].sample_id, path0), (e.sample_id, e.path)]
    assert r.unindexed == [path0]
    other = tmp_path / "other"
    _, entries = make_run(other, n=3)
    append_index(str(other), [{**index_record(entries[2]), "path": "../x.pt"}])
    r = verify_output(str(other), "quick")
    assert [b.reason for b in r.bad] == ["index entry points outside shards/ (not touched)"]
    assert r.unindexed == [entries[2].path] and r.ok == 3


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


@pytest.mark.parametrize("order", [0, 1, 2, 3])
def test_quick_learning_from_read_bytes_gives_check_shards_verdicts(tmp_path, monkeypatch, order):
    """Cold start (no layout known): whichever shard of a size comes first - truncated, longer,
    with another token count in the index, or good - the verdicts and reasons are check_shard's."""
    _, entries = make_run(tmp_path, n=4, length=6)
    damaged = entries[order:] + entries[:order]  # a different shard gets each damage per case
    short, longer, tokens = damaged[0], damaged[1], damaged[2]
    data = (tmp_path / short.path).read_bytes()
    (tmp_path / short.path).write_bytes(data[:-7])
    (tmp_path / longer.path).write_bytes((tmp_path / longer.path).read_bytes() + b"\0")
    append_index(str(tmp_path), [{**index_record(tokens), "num_tokens": 99}])
    rows = load_index(str(tmp_path))
    want = check_batch(
        str(tmp_path), [(e.path, rows[e.sample_id]) for e in entries], "quick", expect(), None
    )
    monkeypatch.setattr(hsx.verify.check, "_LAYOUTS", {})
    r = verify_output(str(tmp_path), "quick")
    assert sorted((b.path, b.reason) for b in r.bad) == sorted((p, why) for p, _, why in want[3])
    assert len(r.bad) == 3 and r.ok == want[1] == 1


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
