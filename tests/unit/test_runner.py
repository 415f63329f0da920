"""`hsx extract` end to end on the tiny model: results, resume, refusals, failures, options."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml
from hsx_run_helpers import (
    LAYERS,
    SharedBackend,
    assert_complete,
    load_shards,
    make_cfg,
    one_thread,  # noqa: F401  (autouse)
    run,
)

import hsx.cores
from extraction.backends.hf import HFBackend
from extraction.cli import main
from extraction.config import ConfigError, build_config
from extraction.dataset import scan_dataset
from extraction.publisher import all_finite
from extraction.runner import Runner
from extraction.runner.forward import forward_cpu_threads
from extraction.runner.lifecycle import Lifecycle
from extraction.runner.plan import QUEUE_BATCHES, assigned_to
from extraction.runner.produce import TOKENIZE_AHEAD_BYTES, tokenize_ahead_batches
from extraction.shards.verify import verify_output
from extraction.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_PAUSED, EXIT_USAGE
from hsx.fsutil import find_orphan_temps
from hsx.index import load_index
from hsx.layout import INDEX_NAME, MANIFEST_NAME
from hsx.status import ERRORS_NAME, read_status
from hsx.verify.scan import scan_shards

N = 20


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_dataset(tmp_path_factory.mktemp("ds") / "d.jsonl", N, seed=7)


@pytest.fixture(scope="module")
def ids(dataset: Path) -> set[str]:
    return {e.sample_id for e in scan_dataset(dataset).entries}


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> SharedBackend:
    return SharedBackend(HFBackend(tiny_model_dir, [1, 3, 4], dtype="fp32"))


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
    monkeypatch.setattr("extraction.publisher.DRAIN_WRITER_THREADS", 4)
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


def test_malformed_rows_logged_run_goes_on(tiny_model_dir, backend, tmp_path) -> None:
    ds = tmp_path / "d.jsonl"
    good = write_tiny_dataset(tmp_path / "g.jsonl", 5, seed=1).read_text().splitlines()
    ds.write_text("\n".join([good[0], "{oops", good[1], '{"messages": []}', *good[2:]]) + "\n")
    out = tmp_path / "out"
    assert run(make_cfg(tiny_model_dir, ds, out), backend) == EXIT_OK
    errors = [json.loads(x) for x in (out / ERRORS_NAME).read_text().splitlines()]
    assert [(e["kind"], e["line"]) for e in errors] == [("row", 2), ("row", 4)]
    assert "invalid JSON" in errors[0]["reason"] and "non-empty list" in errors[1]["reason"]
    assert len(load_index(str(out))) == 5
    assert read_status(str(out))["row_errors"] == 2


def test_retries_then_success(tiny_model_dir, dataset, backend, tmp_path, ids) -> None:
    calls = {"n": 0}

    def flaky(_samples):
        calls["n"] += 1
        return calls["n"] in (2, 3)  # the second batch fails twice, then works

    backend.fail = flaky
    try:
        assert run(make_cfg(tiny_model_dir, dataset, tmp_path / "out", retries=2), backend) == EXIT_OK
    finally:
        backend.fail = None
    assert_complete(tmp_path / "out", ids)
    assert not (tmp_path / "out" / ERRORS_NAME).exists()


def test_poison_sample_logged_others_written(tiny_model_dir, dataset, backend, tmp_path, ids) -> None:
    poison = sorted(ids)[0]
    backend.fail = lambda samples: any(s.sample_id == poison for s in samples)
    try:
        code = run(make_cfg(tiny_model_dir, dataset, tmp_path / "out", retries=1), backend)
    finally:
        backend.fail = None
    assert code == EXIT_FAILED  # finished, but one sample is missing
    assert set(load_index(str(tmp_path / "out"))) == ids - {poison}
    (err,) = [json.loads(x) for x in (tmp_path / "out" / ERRORS_NAME).read_text().splitlines()]
    assert err["sample_id"] == poison and err["attempts"] == 2 and "injected" in err["reason"]
    status = read_status(str(tmp_path / "out"))
    assert status["state"] == "failed" and "1 sample(s) failed" in status["message"]
    # The next run retries just that one.
    assert run(make_cfg(tiny_model_dir, dataset, tmp_path / "out"), backend) == EXIT_OK
    assert_complete(tmp_path / "out", ids)


class _NaNBackend(SharedBackend):
    """States with a NaN for one sample: unchecked (host check) or flagged by the backend itself."""

    def __init__(self, inner, victim: str, flag: bool):
        super().__init__(inner)
        self.victim, self.flag = victim, flag

    def extract(self, samples):
        out = self.inner.extract(samples)
        for r in out:
            if r.sample_id == self.victim:
                r.aux_hidden_state[2, 5] = float("nan")
            if self.flag:
                r.finite = r.sample_id != self.victim
        return out


@pytest.mark.parametrize("flag", [False, True], ids=["host-check", "backend-flag"])
def test_nan_sample_not_written(tiny_model_dir, dataset, backend, tmp_path, ids, flag) -> None:
    victim = sorted(ids)[1]
    out = tmp_path / "out"
    assert (
        run(make_cfg(tiny_model_dir, dataset, out), _NaNBackend(backend.inner, victim, flag)) == EXIT_FAILED
    )
    assert set(load_index(str(out))) == ids - {victim}
    (err,) = [json.loads(x) for x in (out / ERRORS_NAME).read_text().splitlines()]
    assert (
        err["sample_id"] == victim and "NaN or Inf" in err["reason"] and "aux_hidden_state" in err["reason"]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite(dtype) -> None:
    t = torch.randn(7, 64).to(dtype) * 1000
    assert all_finite(t) and all_finite(t[2:5]) and all_finite(t[:, 3:9])
    for bad in (float("nan"), float("inf"), float("-inf")):
        u = t.clone()
        u[4, 60] = bad
        assert not all_finite(u) and not all_finite(u[3:]) and all_finite(u[:4])


def _run_unless_hung(cfg, backend, logs: list[str] | None = None, limit: float = 120) -> int | None:
    """run() on a daemon thread: its exit code, or None when it did not end within `limit`
    seconds (a hung runner fails the test instead of the whole suite)."""
    import threading

    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(run(cfg, backend, logs)), daemon=True)
    t.start()
    t.join(limit)
    return got[0] if got else None


def test_an_unexpected_error_writing_one_shard_fails_that_sample_only(
    tiny_model_dir, dataset, backend, tmp_path, ids, monkeypatch
) -> None:
    from extraction.shards import ShardWriter

    victim = sorted(ids)[3]
    real = ShardWriter.write

    def write(self, sample_id, *a, **k):
        if sample_id == victim:
            raise TypeError("boom")
        return real(self, sample_id, *a, **k)

    monkeypatch.setattr(ShardWriter, "write", write)
    out = tmp_path / "o"
    assert _run_unless_hung(make_cfg(tiny_model_dir, dataset, out), backend) == EXIT_FAILED
    assert set(load_index(str(out))) == ids - {victim}
    (err,) = [json.loads(x) for x in (out / ERRORS_NAME).read_text().splitlines()]
    assert err["sample_id"] == victim and err["reason"] == "write failed: TypeError: boom"
    assert find_orphan_temps(str(out)) == []


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_writer_bug_ends_the_run_instead_of_hanging_it(
    tiny_model_dir, dataset, backend, tmp_path, monkeypatch, writer
) -> None:
    """The forward thread blocks on a full queue when nobody empties it: a writer that died of an
    unexpected error must still empty it, and the run end as failed, saying why."""

    def broken(self, work, outcome):
        raise RuntimeError("bug in the bookkeeping")

    monkeypatch.setattr(Lifecycle, "apply", broken)
    logs: list[str] = []
    # more batches than the queue holds
    cfg = make_cfg(tiny_model_dir, dataset, tmp_path / "o", batch_size=1, publisher=writer)
    assert _run_unless_hung(cfg, backend, logs) == EXIT_FAILED
    assert "the writer failed: RuntimeError: bug in the bookkeeping" in "\n".join(logs)
    index = load_index(str(tmp_path / "o"))  # indexed before the bookkeeping failed: done
    assert len(index) == 1 if writer == "thread" else 1 <= len(index) < N  # the process runs ahead
    r = verify_output(str(tmp_path / "o"), "deep")
    assert r.exit_code == 0 and r.ok == len(index)


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_writer_bug_after_a_pause_fails_the_run(
    tiny_model_dir, dataset, backend, tmp_path, monkeypatch, writer
) -> None:
    """A pause exits 75, which a job unit retries once space is freed; a bug beside it must not
    hide behind it: failed (exit 1), the status saying both."""
    from extraction.diskguard import DiskLow

    def pause_then_break(self, work, outcome):
        self.pause_run(DiskLow(free=1, reserve=2, needed=3, path=str(tmp_path)))
        raise RuntimeError("bug in the bookkeeping")

    monkeypatch.setattr(Lifecycle, "apply", pause_then_break)
    out = tmp_path / "o"
    cfg = make_cfg(tiny_model_dir, dataset, out, batch_size=1, publisher=writer)
    assert _run_unless_hung(cfg, backend) == EXIT_FAILED
    status = read_status(str(out))
    assert status["state"] == "failed", status
    assert "bug in the bookkeeping" in status["message"] and "disk low" in status["message"], status


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_full_disk_in_the_writers_bookkeeping_is_a_pause(
    tiny_model_dir, dataset, backend, tmp_path, monkeypatch, writer
) -> None:
    """ENOSPC from the publishing side's own writes (errors.jsonl, say) pauses the run (75: free
    space), as a full disk while publishing a shard does; it is not a bug that fails it."""
    import errno

    def full(self, work, outcome):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Lifecycle, "apply", full)
    out = tmp_path / "o"
    cfg = make_cfg(tiny_model_dir, dataset, out, batch_size=1, publisher=writer)
    assert _run_unless_hung(cfg, backend) == EXIT_PAUSED
    status = read_status(str(out))
    assert status["state"] == "paused: disk low" and "No space left on device" in status["message"], status
    r = verify_output(str(out), "deep")
    assert r.exit_code == 0


def test_all_finite_runs_no_torch_op() -> None:
    """The writer threads' NaN check must not start an OpenMP team beside the forward pass's:
    nothing but views goes through torch's dispatcher."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    t = torch.randn(300, 192).to(torch.bfloat16)
    with Ops() as ops:
        assert all_finite(t) and all_finite(t[5:])
    views = {"aten.view.dtype", "aten.detach.default", "aten.slice.Tensor", "aten.alias.default"}
    assert "aten.view.dtype" in ops.seen and set(ops.seen) <= views, ops.seen


@pytest.mark.parametrize(
    ("cores", "writers", "threads"),
    [(1, 1, 1), (2, 1, 2), (4, 1, 4), (8, 2, 8), (12, 2, 9), (16, 2, 13), (64, 2, 61)],
)
def test_forward_cpu_threads(cores, writers, threads) -> None:
    assert forward_cpu_threads(cores, writers) == threads


def test_cpu_forward_threads_set_and_restored(
    tiny_model_dir, dataset, backend, tmp_path, monkeypatch
) -> None:
    """On a CPU device the forward runs on the runner's thread count (--cpu-threads, else
    OMP_NUM_THREADS's, else all cores but the pipeline's on a large host, at most the caller's),
    restored afterwards."""
    seen: list[int] = []
    inner = backend.extract
    backend.extract = lambda samples: seen.append(torch.get_num_threads()) or inner(samples)
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(hsx.cores, "usable_cores", lambda: 16)
    try:
        for out, kw, env, caller, want in (
            ("auto", {}, None, 16, 13),
            ("auto-fewer", {}, None, 1, 1),  # never more than the caller's
            ("given", {"cpu_threads": 3}, "5", 1, 3),
            ("omp", {}, "16", 16, 16),  # the formula would give 13
        ):
            if env is not None:
                monkeypatch.setenv("OMP_NUM_THREADS", env)
            torch.set_num_threads(caller)
            seen.clear()
            logs: list[str] = []
            cfg = make_cfg(tiny_model_dir, dataset, tmp_path / out, limit=4, **kw)
            assert run(cfg, backend, logs, writer_threads=2) == EXIT_OK
            assert seen and set(seen) == {want}, (out, seen)
            assert f"forward on {want} torch threads" in "\n".join(logs)
            assert torch.get_num_threads() == caller
    finally:
        torch.set_num_threads(before)


def test_consecutive_errors_abort(tiny_model_dir, dataset, backend, tmp_path) -> None:
    backend.fail = lambda _s: True
    logs: list[str] = []
    try:
        code = run(
            make_cfg(tiny_model_dir, dataset, tmp_path / "out", retries=0, max_consecutive_errors=3),
            backend,
            logs,
        )
    finally:
        backend.fail = None
    assert code == EXIT_FAILED
    status = read_status(str(tmp_path / "out"))
    assert status["state"] == "failed" and "3 samples failed in a row" in status["message"]
    assert status["errors"] == 3 and load_index(str(tmp_path / "out")) == {}


def test_disk_guard_pauses_before_writing(tiny_model_dir, dataset, backend, tmp_path) -> None:
    logs: list[str] = []
    code = run(make_cfg(tiny_model_dir, dataset, tmp_path / "out", reserve_bytes="1P"), backend, logs)
    assert code == EXIT_PAUSED
    status = read_status(str(tmp_path / "out"))
    assert status["state"] == "paused: disk low"
    assert str(status["free_bytes"]) in status["message"] and str(1024**5) in status["message"]
    assert load_index(str(tmp_path / "out")) == {} and scan_shards(str(tmp_path / "out")) == []


def test_shards_split_dataset_without_overlap(tiny_model_dir, dataset, backend, tmp_path, ids) -> None:
    got = []
    for i in range(3):
        out = tmp_path / f"node{i}"
        assert run(make_cfg(tiny_model_dir, dataset, out, shard_index=i, num_shards=3), backend) == EXIT_OK
        got.append(set(load_index(str(out))))
        assert got[-1] == {s for s in ids if assigned_to(s, i, 3)}
    assert set().union(*got) == ids and sum(map(len, got)) == len(ids)
    assert all(got)


def test_tokenizer_runs_ahead_while_the_model_loads(tiny_model_dir, dataset, backend, tmp_path, ids) -> None:
    """All 10 batches are tokenized during a slow model load, not only the forward queue's 4."""
    batches = N // 2
    assert tokenize_ahead_batches(2, 40) > batches > QUEUE_BATCHES
    seen: list[int] = []

    def slow_load(_cfg, _ids):
        deadline = time.monotonic() + 10
        while runner.batch_q.qsize() < batches + 1 and time.monotonic() < deadline:  # + the end mark
            time.sleep(0.01)
        seen.append(runner.batch_q.qsize())
        return backend

    out = tmp_path / "out"
    runner = Runner(
        make_cfg(tiny_model_dir, dataset, out, batch_size=2), backend_factory=slow_load, log=lambda _m: None
    )
    assert runner.run() == EXIT_OK
    assert seen == [batches + 1]
    assert_complete(out, ids)


def test_tokenize_ahead_is_bounded_by_bytes() -> None:
    assert tokenize_ahead_batches(16, 1024) == TOKENIZE_AHEAD_BYTES // (16 * 1024 * 16)
    assert tokenize_ahead_batches(16, None) == TOKENIZE_AHEAD_BYTES // (16 * 32768 * 16)
    assert tokenize_ahead_batches(4096, 1 << 20) == QUEUE_BATCHES


def test_limit(tiny_model_dir, dataset, backend, tmp_path) -> None:
    assert run(make_cfg(tiny_model_dir, dataset, tmp_path / "out", limit=5), backend) == EXIT_OK
    first5 = [e.sample_id for e in scan_dataset(dataset).entries[:5]]
    assert sorted(load_index(str(tmp_path / "out"))) == sorted(first5)
    assert read_status(str(tmp_path / "out"))["total"] == 5


def test_config_file_and_cli_precedence(tmp_path, tiny_model_dir, dataset) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_model_dir),
                "dataset": str(dataset),
                "output": "o",
                "batch-size": 3,
                "layers": [1, 3, 4],
                "reserve_bytes": "2G",
                "dtype": "fp16",
            }
        )
    )
    cfg = build_config({"config": str(conf), "batch_size": 5})
    assert (cfg.batch_size, cfg.layers, cfg.reserve_bytes, cfg.dtype) == (5, "1,3,4", 2 * 1024**3, "fp16")
    conf.write_text("model: m\nbogus: 1\n")
    with pytest.raises(ConfigError, match="unknown option 'bogus'"):
        build_config({"config": str(conf)})
    with pytest.raises(ConfigError, match="shard-index"):
        build_config({"model": "m", "dataset": "d", "output": "o", "shard_index": 3, "num_shards": 2})


def test_cli_end_to_end(tmp_path, tiny_model_dir, capsys) -> None:
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 4, seed=2)
    conf = tmp_path / "c.yaml"
    conf.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_model_dir),
                "dataset": str(ds),
                "layers": LAYERS,
                "dtype": "fp32",
                "max_length": 24,
                "progress": "off",
            }
        )
    )
    out = tmp_path / "out"
    assert main(["extract", "--config", str(conf), "--output", str(out)]) == 0
    assert len(load_index(str(out))) == 4
    # A --layers the model cannot capture (8 layers: canonical ids 1..7) is a usage error that says why.
    assert main(["extract", "--config", str(conf), "--output", str(out), "--layers", "1,3,8"]) == EXIT_USAGE
    assert "out of range for a 8-layer model" in capsys.readouterr().err


def test_cli_output_is_never_world_readable(tmp_path, tiny_model_dir) -> None:
    """input_ids reveal the dataset: a manual `hsx extract` under umask 022 (root's usual) writes
    nothing others can read; the unit's own UMask=0027 gives the same (#30 item 11)."""
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 3, seed=3)
    out = tmp_path / "out"
    argv = ["extract", "--model", str(tiny_model_dir), "--dataset", str(ds), "--output", str(out),
            "--layers", LAYERS, "--dtype", "fp32", "--max-length", "24", "--progress", "off"]
    old = os.umask(0o022)
    try:
        assert main(argv) == 0
        after = os.umask(0o022)
    finally:
        os.umask(old)
    assert after == 0o022, f"main() left the process's umask at {after:o}"  # it also runs in-process
    assert len(load_index(str(out))) == 3
    assert out.stat().st_mode & 0o007 == 0, oct(out.stat().st_mode)
    readable = [
        str(p.relative_to(out))
        for p in [out, *out.rglob("*")]
        if p.stat().st_mode & 0o004 and p.name != "metrics.prom"  # 0644 for node_exporter, inside a 0750 OUTPUT
    ]
    assert not readable, readable


def test_tokenizer_runs_in_a_child_process_same_bits_and_row_errors(
    tiny_model_dir, dataset, backend, tmp_path, ids, monkeypatch
) -> None:
    """The chat template is rendered in a forked process (its Python never holds this process's
    GIL); the shards are bit-identical to tokenizing on a thread, and a row the template cannot
    render is still logged with its line while the run goes on."""
    from extraction.dataset import ChatTokenizer

    pids = tmp_path / "encode-pids"
    poison = sorted(ids)[3]
    real = ChatTokenizer.encode

    def encode(self, conv):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        if conv.sample_id == poison:
            raise ValueError("template cannot render this row")
        return real(self, conv)

    monkeypatch.setattr(ChatTokenizer, "encode", encode)
    outs = {}
    for mode in ("process", "thread"):
        pids.unlink(missing_ok=True)
        outs[mode] = tmp_path / mode
        cfg = make_cfg(tiny_model_dir, dataset, outs[mode])
        # a row that cannot be tokenized is a data error, as a malformed one
        assert run(cfg, backend, tokenizer_process=mode == "process") == EXIT_OK
        seen = {int(x) for x in pids.read_text().split()}
        assert (seen != {os.getpid()}) if mode == "process" else (seen == {os.getpid()}), (mode, seen)
        errors = [json.loads(x) for x in (outs[mode] / ERRORS_NAME).read_text().splitlines()]
        assert [(e["kind"], e.get("sample_id")) for e in errors] == [("row", poison)]
        assert "tokenization failed: template cannot render this row" in errors[0]["reason"]
        assert sorted(load_index(str(outs[mode]))) == sorted(ids - {poison})
        status = read_status(str(outs[mode]))
        assert status["row_errors"] == 1 and status["total"] == N - 1 == status["done"]
    got, want = load_shards(outs["process"]), load_shards(outs["thread"])
    assert sorted(got) == sorted(want) == sorted(ids - {poison})
    for sid, t in want.items():
        for key, value in t.items():
            assert torch.equal(got[sid][key], value), (sid, key)


def test_tokenizer_process_killed_fails_the_run_with_the_reason(
    tiny_model_dir, dataset, backend, tmp_path, ids, monkeypatch
) -> None:
    """The tokenizer process dies (OOM killer, kill -9): the run stops with a message saying so,
    exit 1; what was written is whole and indexed, and a rerun finishes the rest."""
    from extraction.dataset import ChatTokenizer

    real = ChatTokenizer.encode
    count = [0]
    parent = os.getpid()

    def encode(self, conv):
        count[0] += 1
        if count[0] == 18 and os.getpid() != parent:  # in the second planning window
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, conv)

    monkeypatch.setattr(ChatTokenizer, "encode", encode)
    out, logs = tmp_path / "out", []
    assert run(make_cfg(tiny_model_dir, dataset, out, batch_size=1), backend, logs) == EXIT_FAILED
    assert any("the tokenizer process failed" in m and "killed by SIGKILL" in m for m in logs), logs
    status = read_status(str(out))
    assert status["state"] == "failed" and "tokenizer process" in status["message"]
    done = load_index(str(out))
    assert len(done) < N
    r = verify_output(str(out), "quick")
    assert r.exit_code == 0 and r.ok == len(done)
    monkeypatch.setattr(ChatTokenizer, "encode", real)
    assert run(make_cfg(tiny_model_dir, dataset, out, batch_size=1), backend) == EXIT_OK
    assert_complete(out, ids)
