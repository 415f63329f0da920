"""`hsx extract` end to end on the tiny model: what a run writes (bit for bit against the model, on the
async path and with parallel writers), the batch's one index write, resume, and the refusal to
resume into another run. Failures: test_runner_failures.py; options and the CLI: test_runner_options.py.
Shared fixtures (the tiny dataset, its ids, the loaded backend): hsx_run_helpers."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from hsx_run_helpers import (
    N,
    SharedBackend,
    assert_complete,
    load_shards,
    make_cfg,
    one_thread,  # noqa: F401  (autouse)
    run,
)

import hsx.cores
from extraction.runner import Runner
from extraction.testbed.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_OK, EXIT_PAUSED, EXIT_USAGE
from hsx.index import load_index
from hsx.layout import INDEX_NAME, MANIFEST_NAME
from hsx.status import read_status


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, dataset: Path, backend: SharedBackend, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "out"
    assert run(make_cfg(tiny_model_dir, dataset, out), backend) == EXIT_OK
    return out


def test_run_writes_every_sample_matching_the_model(
    reference: Path, ids: set[str], backend, tiny_model_dir
) -> None:
    assert_complete(reference, ids)
    manifest = json.loads((reference / MANIFEST_NAME).read_text())
    assert manifest["layer_ids"] == [1, 3, 4] and manifest["layer_convention"] == "sglang"
    assert manifest["dtype"] == "float32" and manifest["hidden_size"] == 64 and manifest["final_normed"]
    assert manifest["dataset_hash"] and manifest["tokenizer_hash"] and manifest["chat_template_hash"]
    assert manifest["extra"]["max_length"] == 40
    status = read_status(str(reference))
    assert status["state"] == "done" and status["done"] == status["total"] == N == status["written"]
    for key in (
        "skipped_existing",
        "errors",
        "samples_per_s",
        "tokens_per_s",
        "eta_s",
        "bytes_written",
        "free_bytes",
        "pid",
        "host",
        "started_at",
        "updated_at",
        "history",
    ):
        assert key in status, key
    # A shard holds what the backend computes for that sample (compared within float tolerance:
    # the run batched it, this call does not).
    shards = load_shards(reference)
    sid, t = next(iter(sorted(shards.items())))
    from extraction.backends.base import Sample

    (r,) = backend.inner.extract([Sample(sid, t["input_ids"], t["loss_mask"])])
    assert torch.allclose(r.aux_hidden_state, t["aux_hidden_state"][0], atol=1e-5)
    assert t["hidden_state"].shape == (1, len(t["input_ids"]), 64)
    assert any(int(x["loss_mask"].sum()) > 0 for x in shards.values())


class _AsyncShared(SharedBackend):
    """The hf backend's asynchronous path (the one `hsx extract` uses), model kept across runs."""

    def extract_async(self, samples):
        return self.inner.extract_async(samples)


def test_async_extract_and_parallel_writers_write_the_same_bits(
    tiny_model_dir, dataset, backend, reference, tmp_path, ids, monkeypatch
) -> None:
    """Views of the batch buffer copied by the writer, and 2 writer threads: same shards, bit for bit."""
    out = tmp_path / "out"
    assert (
        run(make_cfg(tiny_model_dir, dataset, out), _AsyncShared(backend.inner), writer_threads=2) == EXIT_OK
    )
    assert_complete(out, ids)
    got, want = load_shards(out), load_shards(reference)
    for sid, t in want.items():
        for key, value in t.items():
            assert torch.equal(got[sid][key], value), (sid, key)
    for entry in load_index(str(out)).values():  # each shard owns its bytes: no batch storage
        assert entry.size < entry.num_tokens * (4 * 64 * 4 + 16) + 8192, entry


class _SlowCopy(_AsyncShared):
    """Each batch's copy to the host takes 0.1 s: the writer falls behind the forward pass."""

    def extract_async(self, samples):
        time.sleep(0.03)
        pending = self.inner.extract_async(samples)
        wait = pending.wait
        pending.wait = lambda: (time.sleep(0.1), wait())[1]
        return pending


def test_shards_left_when_the_forward_ends_are_published_by_more_threads(
    tiny_model_dir, dataset, backend, tmp_path, ids, monkeypatch
) -> None:
    """The drain: while the forward runs, one writer; the batches still queued when it has ended
    (the tail the run waits for) go to DRAIN_WRITER_THREADS threads at once. (Writer threads:
    the writer process's own are seen in test_writer_process.)"""
    monkeypatch.setattr("extraction.publish.publisher.DRAIN_WRITER_THREADS", 4)
    monkeypatch.setattr(hsx.cores, "usable_cores", lambda: 4)
    from extraction.shards.writer import ShardWriter

    seen: list[tuple[bool, str]] = []
    write = ShardWriter.write
    cfg = make_cfg(tiny_model_dir, dataset, tmp_path / "out", batch_size=2, publisher="thread")
    runner = Runner(cfg, lambda _c, _i: _SlowCopy(backend.inner), writer_threads=1)

    def recording(self, *a, **k):
        seen.append((runner.forward_done.is_set(), __import__("threading").current_thread().name))
        time.sleep(0.02)
        return write(self, *a, **k)

    monkeypatch.setattr(ShardWriter, "write", recording)
    assert runner.run() == EXIT_OK
    assert_complete(tmp_path / "out", ids)
    during = {name for done, name in seen if not done}
    after = {name for done, name in seen if done}
    assert during == {"hsx-writer"}, seen  # the run's one writer thread
    assert len(after) >= 2 and "hsx-writer" not in after, seen


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_batch_is_indexed_with_one_write_and_a_full_disk_then_takes_the_whole_batch_back(
    tiny_model_dir, dataset, backend, reference, tmp_path, ids, monkeypatch, writer
) -> None:
    """The writer commits a batch's index lines at once (one write + fsync, not one a shard). When
    that write finds the disk full, the batch's shards are taken back (not indexed = not done, no
    file left), the run pauses (75), and the next run redoes them: same shards, bit for bit."""
    from extraction.shards import writer as writer_mod

    real = writer_mod.write_index_bytes
    log = tmp_path / "index-writes"  # a file: the writer process's calls are seen here too

    def counting(fd, data, fsync=True):
        with open(log, "a") as f:
            f.write(str(data.count(b"\n")) + "\n")
        if len(log.read_text().split()) == 3:
            raise OSError(28, "No space left on device")
        return real(fd, data, fsync)

    monkeypatch.setattr(writer_mod, "write_index_bytes", counting)
    out = tmp_path / "out"
    cfg = make_cfg(tiny_model_dir, dataset, out, publisher=writer)  # batches of 4
    assert run(cfg, _AsyncShared(backend.inner), writer_threads=2) == EXIT_PAUSED
    assert log.read_text().split() == ["4", "4", "4"]
    index = load_index(str(out))
    assert len(index) == 8
    on_disk = {p.name for p in (out / "shards").rglob("*.pt")}
    assert on_disk == {os.path.basename(e.path) for e in index.values()}  # the third batch taken back
    monkeypatch.setattr(writer_mod, "write_index_bytes", real)
    assert run(cfg, _AsyncShared(backend.inner), writer_threads=2) == EXIT_OK
    assert_complete(out, ids)
    got, want = load_shards(out), load_shards(reference)
    assert all(torch.equal(got[sid][k], v) for sid, t in want.items() for k, v in t.items())


def test_resume_skips_done_and_redoes_a_damaged_shard(
    tiny_model_dir, dataset, backend, reference, tmp_path, ids
) -> None:
    import shutil

    out = tmp_path / "out"
    shutil.copytree(reference, out)
    index = load_index(str(out))
    victim = sorted(index)[3]
    path = out / index[victim].path
    path.write_bytes(path.read_bytes()[:100])  # truncated by a crash, still indexed
    logs: list[str] = []
    assert run(make_cfg(tiny_model_dir, dataset, out), backend, logs) == EXIT_OK
    status = read_status(str(out))
    assert status["skipped_existing"] == N - 1 and status["written"] == 1
    assert any("1 indexed shard(s) failed quick" in m for m in logs)
    assert_complete(out, ids)
    assert torch.equal(
        load_shards(out)[victim]["aux_hidden_state"], load_shards(reference)[victim]["aux_hidden_state"]
    )


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"layers": "1,2,4"}, "layer_ids"),
        ({"dtype": "bf16"}, "dtype"),
        ({"max_length": 41}, "max_length"),
        ({"dataset": "other"}, "dataset_hash"),
    ],
)
def test_resume_into_other_run_refused(
    tiny_model_dir, dataset, backend, reference, tmp_path, change, says, capsys
) -> None:
    before = sorted(p.name for p in reference.rglob("*"))
    index_before = (reference / INDEX_NAME).read_bytes()
    kw = dict(change)
    if kw.get("dataset") == "other":
        kw["dataset"] = str(write_tiny_dataset(tmp_path / "d.jsonl", N, seed=8))
        kw["dataset"] = str(Path(kw["dataset"]).rename(tmp_path / dataset.name))
    logs: list[str] = []
    assert (
        run(make_cfg(tiny_model_dir, kw.pop("dataset", dataset), reference, **kw), backend, logs)
        == EXIT_USAGE
    )
    assert any("refusing" in m or "different run" in m for m in logs), logs
    assert any(says in m for m in logs), logs
    assert sorted(p.name for p in reference.rglob("*")) == before
    assert (reference / INDEX_NAME).read_bytes() == index_before
