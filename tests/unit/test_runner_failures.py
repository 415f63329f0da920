"""`hsx extract` on the tiny model when things go wrong: malformed rows, retries, poison and NaN samples,
writer errors and bugs (never a hang), a full disk in the bookkeeping, consecutive errors, the disk
guard. Shared fixtures: hsx_run_helpers."""

from __future__ import annotations

import json

import pytest
import torch
from hsx_run_helpers import (
    N,
    SharedBackend,
    assert_complete,
    make_cfg,
    one_thread,  # noqa: F401  (autouse)
    run,
)

from extraction.publish.publisher import all_finite
from extraction.runner.lifecycle import Lifecycle
from extraction.shards.verify import verify_output
from extraction.testbed.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_PAUSED
from hsx.fsutil import find_orphan_temps
from hsx.index import load_index
from hsx.status import ERRORS_NAME, read_status
from hsx.verify.scan import scan_shards


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
    from extraction.publish.diskguard import DiskLow

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
