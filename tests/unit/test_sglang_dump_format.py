"""The dump file format 2 (hsx_dump_format.write_dump -> dumps._load): round trip, and every way a file in
the dump directory can lie, refused with the path and what is wrong (#29)."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import struct

import pytest
import torch

from extraction.sglang import dumps, hook, hsx_dump_format

RID, ROWS, H = "hsx-abcd0123-s-0", 6, 5


def _header(**overrides):
    base = {
        "format": hsx_dump_format.FORMAT,
        "rid": RID,
        "offset": 0,
        "seq_len": ROWS,
        "layer_ids": [1, 2, 3],
        "capture_owner": hook.OWNER_HOOK,
        "sglang_version": "0.5.23",
    }
    return {**base, **overrides}


def _tensors(rows=ROWS):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (rows,), generator=g)
    hidden = torch.randn(rows, H, generator=g).to(torch.bfloat16)
    parts = [torch.randn(rows, H, generator=g).to(torch.bfloat16) for _ in range(3)]
    return ids, hidden, parts


@pytest.fixture
def dump(tmp_path):
    path = tmp_path / hsx_dump_format.dump_name(RID, 0)
    ids, hidden, parts = _tensors()
    hsx_dump_format.write_dump(str(path), _header(), (ids, hidden, parts))
    return path, (ids, hidden, torch.cat(parts, dim=-1))


def test_a_dump_reads_back_with_the_aux_parts_interleaved(dump):
    path, (ids, hidden, aux) = dump
    record = dumps._load(str(path), RID)
    assert {k: record[k] for k in dumps._FIELDS} == _header()
    for key, want in zip(dumps._KEYS, (ids, hidden, aux), strict=True):
        assert record[key].dtype == want.dtype and torch.equal(record[key], want), key
    with open("/proc/self/maps", encoding="utf-8") as maps:
        assert str(path) not in maps.read()  # read into memory of ours, never mapped (#38)
    size = path.stat().st_size
    assert size % hsx_dump_format.DUMP_ALIGN == (aux.numel() * 2) % hsx_dump_format.DUMP_ALIGN  # ends with the aux bytes


def test_one_packed_aux_part_and_a_chunked_request_read_back(tmp_path):
    ids, hidden, parts = _tensors(10)
    packed = torch.cat(parts, dim=-1)
    for offset, (s, e) in ((0, (0, 4)), (4, (4, 10))):
        name = tmp_path / hsx_dump_format.dump_name(RID, offset)
        hsx_dump_format.write_dump(str(name), _header(offset=offset, seq_len=e), (ids[s:e], hidden[s:e], [packed[s:e]]))
    got = dumps.read_request(str(tmp_path), RID, expected_len=10)
    assert got.pieces == 2 and torch.equal(got.aux_hidden_state, packed) and torch.equal(got.input_ids, ids)


def _rewrite(path, edit):
    """Rewrite the dump's header through `edit(meta)` keeping every tensor where it was."""
    raw = path.read_bytes()
    _magic, length = hsx_dump_format.DUMP_HEAD.unpack_from(raw)
    meta = json.loads(raw[hsx_dump_format.DUMP_HEAD.size : hsx_dump_format.DUMP_HEAD.size + length])
    start = meta["tensors"]["input_ids"]["at"]
    edit(meta)
    text = json.dumps(meta).encode()
    head = hsx_dump_format.DUMP_HEAD.pack(hsx_dump_format.DUMP_MAGIC, len(text)) + text
    assert len(head) <= start
    path.write_bytes(head + bytes(start - len(head)) + raw[start:])


def _set(*keys, value):
    def edit(meta):
        node = meta
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value

    return edit


BAD_HEADERS = [
    (_set("format", value=hsx_dump_format.FORMAT_V1), "format 'hsx-sglang-dump/1', expected"),
    (_set("rid", value="hsx-other-s-0"), "holds request 'hsx-other-s-0'"),
    (_set("offset", value="0"), "header field 'offset' missing or not int"),
    (_set("seq_len", value=True), "header field 'seq_len' missing or not int"),
    (_set("layer_ids", value=[1, "2"]), "layer_ids .* are not all integers"),
    (_set("tensors", value={"input_ids": {}}), "header tensors must be exactly"),
    (_set("tensors", "hidden_state", "dtype", value="complex64"), "header entry for hidden_state is invalid"),
    (_set("tensors", "input_ids", "dtype", value="float32"), "header entry for input_ids is invalid"),
    (_set("tensors", "hidden_state", "dtype", value="float32"), "hidden_state and aux_hidden_state differ"),
    (_set("tensors", "aux_hidden_state", "dtype", value="float32"), "the tensors end at byte"),
    (_set("tensors", "hidden_state", "shape", value=[ROWS, -H]), "header entry for hidden_state is invalid"),
    (_set("tensors", "hidden_state", "shape", value=[ROWS]), "header entry for hidden_state is invalid"),
    (_set("tensors", "input_ids", "shape", value=[ROWS + 1]), "input_ids missing or not|hidden_state missing or not"),
    (_set("tensors", "aux_hidden_state", "at", value=0), "header entry for aux_hidden_state is invalid"),
    (_set("tensors", "aux_hidden_state", "at", value=8192 + 64), "header entry for aux_hidden_state is invalid"),
    (_set("tensors", "hidden_state", "at", value=2**62), "header entry for hidden_state is invalid"),
]


@pytest.mark.parametrize("edit, reason", BAD_HEADERS)
def test_a_lying_header_is_refused_naming_the_file(dump, edit, reason):
    path, _ = dump
    _rewrite(path, edit)
    with pytest.raises(dumps.DumpError, match=reason) as e:
        dumps._load(str(path), RID)
    assert str(path) in str(e.value)


def test_a_truncated_or_padded_file_is_refused(dump):
    path, _ = dump
    raw = path.read_bytes()
    for cut in (raw[:-1], raw + b"\0", raw[:20]):
        path.write_bytes(cut)
        with pytest.raises(dumps.DumpError, match="the tensors end at byte|header of"):
            dumps._load(str(path), RID)


def test_broken_magic_json_and_header_length_are_refused(dump):
    path, _ = dump
    raw = path.read_bytes()
    _magic, length = hsx_dump_format.DUMP_HEAD.unpack_from(raw)
    cases = [
        (b"HSXDUMP9" + raw[8:], "not a hsx-sglang-dump/2 dump"),
        (hsx_dump_format.DUMP_HEAD.pack(hsx_dump_format.DUMP_MAGIC, 2**40) + raw[16:], "header of 1099511627776 bytes"),
        (raw[:16] + b"}" + raw[17:], "unreadable header"),
        (b"", "not a hsx-sglang-dump/2 dump"),
    ]
    for data, reason in cases:
        path.write_bytes(data)
        with pytest.raises(dumps.DumpError, match=reason):
            dumps._load(str(path), RID)


def test_a_link_a_fifo_and_a_directory_named_as_a_dump_are_refused_without_waiting(dump, tmp_path):
    path, _ = dump
    link = tmp_path / hsx_dump_format.dump_name(RID, 5)
    link.symlink_to(path)
    with pytest.raises(dumps.DumpError, match="unreadable dump: .*Too many levels of symbolic links"):
        dumps._load(str(link), RID)
    fifo = tmp_path / hsx_dump_format.dump_name(RID, 6)
    os.mkfifo(fifo)
    with pytest.raises(dumps.DumpError, match="not a regular file"):
        dumps._load(str(fifo), RID)  # opened without blocking for a writer
    folder = tmp_path / hsx_dump_format.dump_name(RID, 7)
    folder.mkdir()
    with pytest.raises(dumps.DumpError, match="not a regular file"):
        dumps._load(str(folder), RID)


def test_short_and_interrupted_writes_resume_where_they_stopped(tmp_path, monkeypatch):
    """The writer's writev (libc, through ctypes) may write less than asked or be interrupted:
    a writev that writes at most 7 bytes of its first entry a call, and fails with EINTR every
    third call, gives the same file."""
    ids, hidden, parts = _tensors()
    want = tmp_path / "want"
    hsx_dump_format.write_dump(str(want), _header(), (ids, hidden, parts))
    calls = []

    def dribble(fd, table, count):
        calls.append(count)
        if len(calls) % 3 == 0:
            ctypes.set_errno(errno.EINTR)
            return -1
        base, length = struct.unpack("<QQ", ctypes.string_at(table, 16))
        return os.write(fd, ctypes.string_at(base, min(length, 7)))

    monkeypatch.setattr(hsx_dump_format, "_libc_writev", lambda: dribble)
    got = tmp_path / "got"
    hsx_dump_format.write_dump(str(got), _header(), (ids, hidden, parts))
    assert got.read_bytes() == want.read_bytes() and len(calls) > 100


def test_a_failing_write_raises_with_its_errno(tmp_path, monkeypatch):
    def full(fd, table, count):
        ctypes.set_errno(errno.ENOSPC)
        return -1

    monkeypatch.setattr(hsx_dump_format, "_libc_writev", lambda: full)
    with pytest.raises(OSError) as e:
        hsx_dump_format.write_dump(str(tmp_path / "d"), _header(), _tensors())
    assert e.value.errno == errno.ENOSPC
