"""The atomic writer: real torch.save shards, run.json, index, disk-full and crash leftovers."""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest
import torch
from shard_helpers import H, K, make_run, manifest, tensors

from extraction.shards import (
    DiskFullError,
    ManifestMismatchError,
    ShardDataError,
    ShardWriter,
    remove_orphan_temps,
)
from extraction.shards import writer as writer_mod
from hsx.fsutil import find_orphan_temps
from hsx.index import checksum_string, encode_index_line, load_index
from hsx.layout import INDEX_NAME, SHARD_KEYS, bucket_of, is_temp_name, shard_relpath, temp_name
from hsx.manifest import ManifestError, manifest_mismatches, read_manifest, write_manifest
from hsx.verify import verify_output
from hsx.verify.check import Expect, check_shard


def test_published_shard_is_the_specforge_dict(tmp_path):
    w, (entry,) = make_run(tmp_path, n=1, length=6)
    path = tmp_path / entry.path
    assert entry.path == shard_relpath("s000") and entry.num_tokens == 6
    assert entry.size == path.stat().st_size
    assert entry.checksum == checksum_string(__import__("zlib").crc32(path.read_bytes()))
    data = torch.load(path, mmap=True, weights_only=True)
    assert list(data) == list(SHARD_KEYS)
    assert data["input_ids"].dtype == torch.int64 and data["input_ids"].shape == (6,)
    assert data["loss_mask"].shape == (6,)
    assert data["hidden_state"].shape == (1, 6, H) and data["hidden_state"].dtype == torch.bfloat16
    assert data["aux_hidden_state"].shape == (1, 6, K * H)
    assert load_index(tmp_path) == {"s000": entry}


def test_views_of_a_batch_tensor_save_only_their_bytes(tmp_path):
    w = ShardWriter(tmp_path, manifest(dtype="float32"))
    batch = torch.randn(16, 5, H)
    aux = torch.randn(16, 5, K * H)
    t = tensors(5)
    entry = w.publish("v", t["input_ids"], t["loss_mask"], batch[3], aux[7])
    tensor_bytes = 5 * 8 * 2 + 5 * H * 4 + 5 * K * H * 4
    assert entry.size <= 1.01 * tensor_bytes + 4096
    data = torch.load(tmp_path / entry.path, weights_only=True)
    assert torch.equal(data["hidden_state"][0], batch[3])


def test_shapes_that_do_not_fit_the_run_are_refused_before_writing(tmp_path):
    w = ShardWriter(tmp_path, manifest())
    t = tensors(5)
    with pytest.raises(ShardDataError, match="do not match"):
        w.publish("a", t["input_ids"], t["loss_mask"], torch.randn(6, H), t["aux_hidden_state"])
    with pytest.raises(ShardDataError, match="do not match"):
        w.publish("a", t["input_ids"], t["loss_mask"], t["hidden_state"], torch.randn(5, 2 * H))
    with pytest.raises(ShardDataError, match="NaN"):
        w.publish(
            "a", t["input_ids"], t["loss_mask"], torch.full((5, H), float("nan")), t["aux_hidden_state"]
        )
    assert list((tmp_path / "shards").rglob("*")) == [] and load_index(tmp_path) == {}


def test_manifest_round_trip_and_mismatch_is_refused(tmp_path):
    m = manifest()
    write_manifest(tmp_path, m)
    assert read_manifest(tmp_path) == m
    other = manifest(dtype="float16", layer_ids=[2, 3, 4], created_at="later", extra={"host": "x"})
    lines = manifest_mismatches(m, other)
    assert len(lines) == 2 and lines[0].startswith("dtype:") and "layer_ids" in lines[1]
    with pytest.raises(ManifestMismatchError) as exc:
        ShardWriter(tmp_path, other)
    assert exc.value.mismatches == lines
    ShardWriter(tmp_path, manifest(created_at="later", extra={"host": "y"}))  # same run


def test_manifest_unknown_keys_go_to_extra_and_bad_files_name_the_path(tmp_path):
    write_manifest(tmp_path, manifest())
    data = json.loads((tmp_path / "run.json").read_text())
    data["future_field"] = 1
    (tmp_path / "run.json").write_text(json.dumps(data))
    assert read_manifest(tmp_path).extra == {"future_field": 1}
    (tmp_path / "run.json").write_text("{not json")
    with pytest.raises(ManifestError, match="run.json"):
        read_manifest(tmp_path)
    with pytest.raises(ManifestError, match="not an extraction run"):
        read_manifest(tmp_path / "nope")


class _FullDisk:
    """A real ENOSPC from the kernel: /dev/full accepts the open and fails the writes."""

    def __init__(self, final_dir):
        self.final_dir = final_dir

    def __call__(self, path):
        return open("/dev/full", "wb")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_disk_full_leaves_no_final_file_and_no_temp(tmp_path, monkeypatch):
    w, _ = make_run(tmp_path, n=1)
    monkeypatch.setattr(w, "_open_temp", _FullDisk(tmp_path))
    with pytest.raises(DiskFullError) as exc:
        w.publish("full", **tensors(5))
    assert exc.value.errno == errno.ENOSPC
    assert not (tmp_path / shard_relpath("full")).exists()
    assert find_orphan_temps(str(tmp_path)) == [] and set(load_index(tmp_path)) == {"s000"}


class _TempFileWrapper:
    """A writer's temp file with `write` replaced by a subclass (to inject write failures)."""

    def __init__(self, f):
        self.f = f

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.f.close()


def test_disk_full_mid_write_removes_the_temp(tmp_path, monkeypatch):
    w = ShardWriter(tmp_path, manifest())
    real_open = w._open_temp
    temps = []

    class Failing(_TempFileWrapper):
        n = 0

        def write(self, b):
            self.n += len(b)
            if self.n > 1000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

    def opener(path):
        temps.append(path)
        return Failing(real_open(path))

    monkeypatch.setattr(w, "_open_temp", opener)
    with pytest.raises(DiskFullError):
        w.publish("x", **tensors(50))
    assert temps and not os.path.exists(temps[0])
    assert not (tmp_path / shard_relpath("x")).exists()


def test_disk_full_while_indexing_takes_the_shard_back(tmp_path, monkeypatch):
    w = ShardWriter(tmp_path, manifest())

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_mod, "write_index_bytes", no_space)
    with pytest.raises(DiskFullError):
        w.publish("x", **tensors(5))
    assert not (tmp_path / shard_relpath("x")).exists()


def test_disk_full_part_way_through_a_batch_index_write_leaves_no_line_of_it(tmp_path, monkeypatch):
    """The first write of a batch's lines lands, the second hits ENOSPC: the batch's shards are
    taken back, and so are the lines already written (the index is cut back to where it ended)."""
    w = ShardWriter(tmp_path, manifest())
    w.publish("kept", **tensors(4))
    before = (tmp_path / INDEX_NAME).read_bytes()
    entries = [w.write(f"b{i}", **tensors(4, seed=i)) for i in range(4)]
    real, calls = os.write, []

    def half_then_full(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real(fd, bytes(data[: len(data) // 2 + 80]))  # more than one whole line
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(DiskFullError):
        w.commit(entries)
    monkeypatch.undo()
    assert len(calls) == 2
    assert (tmp_path / INDEX_NAME).read_bytes() == before
    assert set(load_index(tmp_path)) == {"kept"}
    assert not any((tmp_path / e.path).exists() for e in entries)


def test_a_failed_index_write_leaves_lines_another_process_appended_meanwhile(tmp_path, monkeypatch):
    """`hsx verify --quarantine` may append tombstones beside a run: cutting the index back then
    would take their lines too, so it is not cut (the caller's partial line fails its own CRC)."""
    w = ShardWriter(tmp_path, manifest())
    w.publish("kept", **tensors(4))
    entries = [w.write(f"b{i}", **tensors(4, seed=i)) for i in range(2)]
    other = encode_index_line({"sample_id": "tomb", "tombstone": True})
    real, calls = os.write, []

    def partial_then_another_appender_then_full(fd, data):
        calls.append(1)
        if len(calls) == 1:
            return real(fd, bytes(data[:10]))
        with open(tmp_path / INDEX_NAME, "ab") as f:
            f.write(other)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", partial_then_another_appender_then_full)
    with pytest.raises(DiskFullError):
        w.commit(entries)
    monkeypatch.undo()
    assert (tmp_path / INDEX_NAME).read_bytes().endswith(other)


def test_orphan_temps_are_removed_at_startup(tmp_path):
    w, entries = make_run(tmp_path, n=2)
    bucket = (tmp_path / entries[0].path).parent
    (bucket / temp_name("s000.pt")).write_bytes(b"partial")
    (tmp_path / "shards" / ".loose.tmp").write_bytes(b"x")
    (tmp_path / temp_name("run.json")).write_bytes(b"{")
    assert remove_orphan_temps(tmp_path) == 3
    assert w.remove_orphan_temps() == 0
    assert all((tmp_path / e.path).exists() for e in entries)


def test_publish_from_threads(tmp_path):
    w = ShardWriter(tmp_path, manifest(), fsync_index=False)
    errors = []

    def work(start):
        try:
            for i in range(start, start + 10):
                w.publish(f"t{i}", **tensors(4, seed=i))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k * 10,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(load_index(tmp_path)) == 30
    assert verify_output(str(tmp_path), "full").exit_code == 0


def test_republish_replaces_atomically(tmp_path):
    w, (e1,) = make_run(tmp_path, n=1)
    e2 = w.publish("s000", **tensors(7, seed=9))
    assert e2.path == e1.path and e2.num_tokens == 7 and load_index(tmp_path)["s000"] == e2


def _file_object_bytes(w, sid="s", length=7, seed=3):
    import io

    t = tensors(length, seed=seed)
    buf = io.BytesIO()
    torch.save(
        w.build_payload(sid, t["input_ids"], t["loss_mask"], t["hidden_state"], t["aux_hidden_state"]), buf
    )
    return t, buf.getvalue()


def test_written_bytes_equal_torch_save_and_the_checksum_is_of_those_bytes(tmp_path):
    # The direct layout (torchzip) writes exactly torch.save's bytes; no read-back for the CRC.
    w = ShardWriter(tmp_path, manifest())
    assert w._layout is not None and "checked against torch" in w.write_mode
    t, want = _file_object_bytes(w)
    entry = w.publish("s", **t)
    got = (tmp_path / entry.path).read_bytes()
    assert got == want
    assert entry.size == len(got) and entry.checksum == checksum_string(__import__("zlib").crc32(got))
    assert check_shard(
        str(tmp_path / entry.path), Expect.from_manifest(manifest().to_dict()), "full", entry
    )


def test_short_writes_are_continued(tmp_path, monkeypatch):
    w = ShardWriter(tmp_path, manifest())
    t, want = _file_object_bytes(w, length=40)
    real = os.writev
    calls = []

    def dribble(fd, views):  # the kernel may write less than asked: at most 100 bytes here
        calls.append(1)
        first = memoryview(views[0])[:100]
        return real(fd, [first])

    monkeypatch.setattr(writer_mod.os, "writev", dribble)
    entry = w.publish("s", **t)
    assert (tmp_path / entry.path).read_bytes() == want and len(calls) > 10


def test_enospc_from_writev_is_disk_full_and_leaves_nothing(tmp_path, monkeypatch):
    w = ShardWriter(tmp_path, manifest())

    def full(fd, views):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_mod.os, "writev", full)
    with pytest.raises(DiskFullError):
        w.publish("s", **tensors(5))
    assert find_orphan_temps(str(tmp_path)) == [] and not (tmp_path / shard_relpath("s")).exists()
    assert load_index(tmp_path) == {}


def test_without_a_checked_layout_torch_save_writes_the_same_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("HSX_SHARD_WRITER", "torch")
    w = ShardWriter(tmp_path, manifest())
    assert w._layout is None and w.write_mode == "HSX_SHARD_WRITER=torch"
    batch = torch.randn(4, 7, H)  # a view into a larger storage is copied before torch.save
    t, want = _file_object_bytes(w)
    t["hidden_state"] = batch[2].copy_(t["hidden_state"])
    entry = w.publish("s", **t)
    assert (tmp_path / entry.path).read_bytes() == want
    assert entry.checksum == checksum_string(
        __import__("zlib").crc32((tmp_path / entry.path).read_bytes())
    )


def test_a_shard_opens_only_its_temp_file_once_its_folder_and_the_index_are_open(tmp_path, monkeypatch):
    """Folder (for the directory fsync) and index fds stay open across publishes: each system call
    is a GIL hand-over the forward pass waits on. close() closes them; publishing reopens."""
    w = ShardWriter(tmp_path, manifest())
    w.publish("first", **tensors(4))
    sid = next(f"x{i}" for i in range(1000) if bucket_of(f"x{i}") == bucket_of("first"))
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(
        os, "open", lambda path, *a, **k: (opened.append(str(path)), real_open(path, *a, **k))[1]
    )
    w.publish(sid, **tensors(4))
    # the temp file alone, by its name relative to its folder's fd (never through a link)
    assert len(opened) == 1 and is_temp_name(opened[0]) and "/" not in opened[0]
    fds = [*w._dir_fds.values(), w._index_fd]
    w.close()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    w.publish("third", **tensors(4))
    assert set(load_index(tmp_path)) == {"first", sid, "third"}
    assert any(p.endswith(INDEX_NAME) for p in opened)
    w.close()


def test_torch_save_fallback_continues_short_writes(tmp_path, monkeypatch):
    """Where torch.save writes the shard (no checked layout), it ignores a short write's count:
    the writer continues each write itself, so the file is whole (the temp file is unbuffered)."""
    w = ShardWriter(tmp_path, manifest())
    monkeypatch.setattr(w, "_layout", None)
    real_open = w._open_temp

    class Short(_TempFileWrapper):
        def write(self, b):
            return self.f.write(memoryview(b)[:1000])

    monkeypatch.setattr(w, "_open_temp", lambda path: Short(real_open(path)))
    t = tensors(300)
    entry = w.publish("short", **t)
    path = tmp_path / entry.path
    assert entry.size == path.stat().st_size > 1000 * 10
    data = torch.load(path, weights_only=True)
    assert torch.equal(data["input_ids"], t["input_ids"])
    assert check_shard(str(path), Expect.from_manifest(manifest().to_dict()), "full", entry)
