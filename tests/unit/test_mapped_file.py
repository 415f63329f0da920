"""Tensors mapped from a file, and the shard writer copying them out with sendfile (#29)."""

from __future__ import annotations

import errno
import gc
import os

import pytest
import torch
from shard_helpers import manifest, tensors

from extraction.mapped_file import MappedFile, file_range
from extraction.shards import DiskFullError, ShardWriter
from extraction.shards import writer as writer_mod
from extraction.shards.torchzip import tensor_buffer
from hsx.fsutil import find_orphan_temps
from hsx.layout import shard_relpath

ALIGN = 4096


def _mapped(path, named: dict[str, torch.Tensor]) -> tuple[int, dict[str, torch.Tensor]]:
    """Write the tensors' bytes at page-aligned offsets after a page of junk, map the file: its
    descriptor and the mapped views."""
    blob, where = bytearray(b"j" * ALIGN), {}
    for name, t in named.items():
        where[name] = len(blob)
        blob += t.contiguous().view(torch.uint8).numpy().tobytes()
        blob += bytes(-len(blob) % ALIGN)
    path.write_bytes(bytes(blob))
    fd = os.open(path, os.O_RDONLY)
    mapped = MappedFile(fd)
    return fd, {name: mapped.tensor(t.dtype, list(t.shape), where[name]) for name, t in named.items()}


def test_a_mapped_tensor_is_the_files_bytes_its_range_is_found_and_its_fd_closed(tmp_path):
    src = torch.arange(1000, dtype=torch.int64)
    fd, views = _mapped(tmp_path / "f", {"a": src})
    t = views.pop("a")
    assert torch.equal(t, src)
    assert file_range(tensor_buffer(t[10:20])) == (fd, ALIGN + 80)
    assert file_range(tensor_buffer(src)) is None  # not mapped
    assert file_range(memoryview(b"abc")) is None  # read-only bytes
    t[0] = 5  # private: the file keeps its bytes
    assert (tmp_path / "f").read_bytes()[ALIGN : ALIGN + 8] == bytes(8)
    os.fstat(fd)
    del t
    gc.collect()
    with pytest.raises(OSError) as e:  # the mapping is gone: its descriptor with it
        os.fstat(fd)
    assert e.value.errno == errno.EBADF


def test_a_tensor_outside_the_file_is_refused(tmp_path):
    (tmp_path / "f").write_bytes(bytes(100))
    mapped = MappedFile(os.open(tmp_path / "f", os.O_RDONLY))
    with pytest.raises(ValueError, match="outside the file"):
        mapped.tensor(torch.float32, [30], 0)


def _shard_inputs(w, length=40):
    t = tensors(length, seed=7)
    t["hidden_state"] = t["hidden_state"].to(w._dtype)
    t["aux_hidden_state"] = t["aux_hidden_state"].to(w._dtype)
    return t


def _sendfile_spy(monkeypatch, behave=None):
    sent = []
    real = os.sendfile

    def spy(out_fd, in_fd, offset, count):
        if behave is not None:
            return behave(real, out_fd, in_fd, offset, count, sent)
        n = real(out_fd, in_fd, offset, count)
        sent.append(n)
        return n

    monkeypatch.setattr(writer_mod.os, "sendfile", spy)
    return sent


def test_a_shard_of_mapped_tensors_is_copied_by_the_kernel_byte_for_byte(tmp_path, monkeypatch):
    plain = ShardWriter(tmp_path / "plain", manifest())
    t = _shard_inputs(plain)
    want = (tmp_path / "plain" / plain.publish("s", **t).path).read_bytes()
    sent = _sendfile_spy(monkeypatch)
    _fd, views = _mapped(tmp_path / "dump", {k: t[k] for k in ("hidden_state", "aux_hidden_state")})
    w = ShardWriter(tmp_path / "out", manifest())
    entry = w.publish("s", t["input_ids"], t["loss_mask"], views["hidden_state"], views["aux_hidden_state"])
    assert (tmp_path / "out" / entry.path).read_bytes() == want
    assert sum(sent) == sum(v.numel() * v.element_size() for v in views.values())


def test_where_sendfile_is_not_supported_the_rest_is_written(tmp_path, monkeypatch):
    plain = ShardWriter(tmp_path / "plain", manifest())
    t = _shard_inputs(plain)
    want = (tmp_path / "plain" / plain.publish("s", **t).path).read_bytes()

    def some_then_einval(real, out_fd, in_fd, offset, count, sent):
        if sent:
            raise OSError(errno.EINVAL, "Invalid argument")
        sent.append(real(out_fd, in_fd, offset, min(count, 100)))
        return sent[-1]

    sent = _sendfile_spy(monkeypatch, some_then_einval)
    _fd, views = _mapped(tmp_path / "dump", {k: t[k] for k in ("hidden_state", "aux_hidden_state")})
    w = ShardWriter(tmp_path / "out", manifest())
    entry = w.publish("s", t["input_ids"], t["loss_mask"], views["hidden_state"], views["aux_hidden_state"])
    assert (tmp_path / "out" / entry.path).read_bytes() == want and sent == [100]


def test_enospc_from_sendfile_is_disk_full_and_leaves_nothing(tmp_path, monkeypatch):
    def full(real, out_fd, in_fd, offset, count, sent):
        raise OSError(errno.ENOSPC, "No space left on device")

    _sendfile_spy(monkeypatch, full)
    w = ShardWriter(tmp_path / "out", manifest())
    t = _shard_inputs(w)
    _fd, views = _mapped(tmp_path / "dump", {"hidden_state": t["hidden_state"]})
    with pytest.raises(DiskFullError):
        w.publish("s", t["input_ids"], t["loss_mask"], views["hidden_state"], t["aux_hidden_state"])
    assert find_orphan_temps(str(tmp_path / "out")) == [] and not (tmp_path / "out" / shard_relpath("s")).exists()
