"""The fast paths of verification in one process: each must reach the same verdicts as the plain path.

The layout memo's compared regions, the index's one-comparison line check (index_rows) and the single
directory pass for shards and orphan temps, quick's fast path and what it sends to the plain checks.
CRC32 libraries: test_shard_verify_crc.py; threads and forked workers: test_shard_verify_workers.py.
"""

from __future__ import annotations

import os
import signal
import zlib
from pathlib import Path

import pytest
from shard_helpers import expect, flip, make_run

import hsx.cores
import hsx.crc
import hsx.verify.check
import hsx.verify.full
import hsx.verify.pool
import hsx.verify.quick
import hsx.verify.quick_split
import hsx.ziprecords
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
from hsx.verify.scan import list_shards, scan_shards
from hsx.ziprecords import ShardReader, ZipRecord, read_zip_records


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
