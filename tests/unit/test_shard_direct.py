"""The shard writer's O_DIRECT path (extraction/shards/direct.py, #49 item 6): the bytes a
DirectSink writes are exactly those handed to it, whatever their sizes and however the file
system answers: O_DIRECT refused, a direct write refused (EINVAL) or short."""

from __future__ import annotations

import errno
import os

import pytest

from extraction.shards import direct
from extraction.shards.direct import ALIGN, CHUNK_ROOM, STAGING, DirectSink


def _write(path, parts: list[tuple[str, bytes]]) -> DirectSink:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        sink = DirectSink(fd)
        for how, data in parts:
            if how == "put":
                sink.put(data)
            else:  # as FileBytes.copy_to fills it: room, then advance
                for at in range(0, len(data), CHUNK_ROOM):
                    piece = data[at : at + CHUNK_ROOM]
                    sink.room(len(piece))[:] = piece
                    sink.advance(len(piece))
        sink.finish()
        os.fsync(fd)
    finally:
        os.close(fd)
    return sink


def _parts(seed: int) -> list[tuple[str, bytes]]:
    """A shard's shape of writes: small headers of odd lengths, large states crossing the staging
    buffer's end, a tail of under ALIGN bytes."""
    sizes = [1, 63, ALIGN - 1, ALIGN + 1, 3 * CHUNK_ROOM + 5, 2, STAGING + 4099, 77, 5 * CHUNK_ROOM, 1234]
    return [("put" if (i + seed) % 2 == 0 else "room", os.urandom(n)) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_bytes_written_are_the_bytes_given(tmp_path, seed):
    parts = _parts(seed)
    sink = _write(tmp_path / "f", parts)
    assert (tmp_path / "f").read_bytes() == b"".join(d for _h, d in parts)
    assert sink.fill == 0


def test_nothing_at_all_and_exactly_aligned(tmp_path):
    _write(tmp_path / "empty", [])
    assert (tmp_path / "empty").read_bytes() == b""
    data = os.urandom(2 * STAGING)
    _write(tmp_path / "aligned", [("room", data)])
    assert (tmp_path / "aligned").read_bytes() == data


def test_a_file_system_that_refuses_o_direct_gets_ordinary_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(direct, "set_direct", lambda fd, on: False)
    parts = _parts(2)
    sink = _write(tmp_path / "f", parts)
    assert sink.direct is False
    assert (tmp_path / "f").read_bytes() == b"".join(d for _h, d in parts)


@pytest.mark.parametrize("how", ["einval", "short"])
def test_a_refused_or_short_direct_write_goes_on_buffered(tmp_path, monkeypatch, how):
    """EINVAL from a direct write (a file system that took the flag but not the write), or a
    short count (the rest no longer aligned): O_DIRECT is cleared and the write goes on."""
    real_write, calls = os.write, []

    def write(fd, view):
        calls.append(len(view))
        if len(calls) == 1:
            if how == "einval":
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_write(fd, view[: len(view) // 2 + 1])  # an odd count
        return real_write(fd, view)

    monkeypatch.setattr(direct.os, "write", write)
    parts = _parts(3)
    sink = _write(tmp_path / "f", parts)
    assert sink.direct is False and len(calls) > 2
    assert (tmp_path / "f").read_bytes() == b"".join(d for _h, d in parts)


def test_room_is_bounded():
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        with pytest.raises(ValueError, match="at most"):
            DirectSink(fd).room(CHUNK_ROOM + 1)
    finally:
        os.close(fd)
