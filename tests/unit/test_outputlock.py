"""One runner per output directory (extraction/process/outputlock.py), with the real runner and a real
second process holding the lock."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hsx_run_helpers import SharedBackend, make_cfg, one_thread, run  # noqa: F401  (one_thread: autouse)

from extraction.backends.hf import HFBackend
from extraction.process.outputlock import LOCK_NAME, OutputBusy, OutputLock
from extraction.runner import Runner
from extraction.testbed.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_PAUSED
from hsx.index import load_index

_HOLD = """
import os, socket, sys, time
from extraction.process.outputlock import OutputLock
lock = OutputLock(sys.argv[1])
lock.acquire()
if len(sys.argv) > 3:  # another pid recorded as the holder: a runner killed since
    os.ftruncate(lock._fd, 0)
    os.pwrite(lock._fd, f"pid {sys.argv[3]} on {socket.gethostname()} since then\\n".encode(), 0)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _holding(out: Path, seconds: float, recorded_pid: int | None = None) -> subprocess.Popen:
    """Another process holding `out`'s lock for `seconds` (as a second runner would), once it holds it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-c", _HOLD, str(out), str(seconds)]
    if recorded_pid is not None:
        argv.append(str(recorded_pid))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> SharedBackend:
    return SharedBackend(HFBackend(tiny_model_dir, [1, 3, 4], dtype="fp32"))


@pytest.fixture
def holder(tmp_path: Path):
    """Another process holding the output (as a second runner would), until killed."""
    out = tmp_path / "out"
    out.mkdir()
    proc = _holding(out, 120)
    yield out, proc
    proc.kill()
    proc.wait()


def test_a_second_runner_is_refused_and_touches_nothing(tiny_model_dir, backend, tmp_path, holder) -> None:
    out, proc = holder
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 4, seed=1)
    orphan = out / ".s0.pt.1234.tmp"  # the holder's temp file in flight: must survive the refusal
    orphan.write_bytes(b"in flight")
    logs: list[str] = []
    assert run(make_cfg(tiny_model_dir, ds, out), backend, logs) == EXIT_FAILED
    assert f"is in use by another hsx extract (pid {proc.pid} on " in "\n".join(logs), logs
    assert sorted(p.name for p in out.iterdir()) == sorted([LOCK_NAME, orphan.name])
    proc.kill()
    proc.wait()  # the holder gone (killed: no unlock of its own), the output is free
    assert run(make_cfg(tiny_model_dir, ds, out), backend) == EXIT_OK
    assert len(load_index(str(out))) == 4 and not orphan.exists()


def test_the_lock_is_dropped_after_a_run_and_held_during_it(tiny_model_dir, backend, tmp_path) -> None:
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 4, seed=1)
    out = tmp_path / "out"
    seen: list[str] = []
    inner = backend.extract

    def probe(samples):  # mid-run: a second taker is refused
        try:
            OutputLock(str(out)).acquire()
            seen.append("free")
        except OutputBusy as e:
            seen.append(str(e))
        return inner(samples)

    backend.extract = probe
    runner = Runner(make_cfg(tiny_model_dir, ds, out, batch_size=4), lambda _c, _i: backend, lambda _m: None)
    try:
        assert runner.run() == EXIT_OK
    finally:
        backend.extract = inner
    assert seen and all(f"(pid {os.getpid()} on " in s for s in seen), seen
    lock = OutputLock(str(out))
    lock.acquire()  # after the run, the runner still alive: free
    lock.release()


def test_a_filesystem_without_locks_runs_unlocked_saying_so(
    tiny_model_dir, backend, tmp_path, monkeypatch
) -> None:
    import errno

    from extraction.process import outputlock

    def no_locks(_fd, _op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(outputlock.fcntl, "flock", no_locks)
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 2, seed=1)
    logs: list[str] = []
    assert run(make_cfg(tiny_model_dir, ds, tmp_path / "out"), backend, logs) == EXIT_OK
    assert any("no lock on" in m and "No locks available" in m for m in logs), logs


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_runner_just_killed_is_waited_for_not_refused(tiny_model_dir, backend, tmp_path) -> None:
    """After a kill -9 the runner is gone but the kernel is still tearing its writer process down
    (which has the lock file open): the resume waits for that instead of refusing."""
    out = tmp_path / "out"
    out.mkdir()
    lingering = _holding(out, 1.0, recorded_pid=_dead_pid())
    try:
        ds = write_tiny_dataset(tmp_path / "d.jsonl", 2, seed=1)
        t = time.monotonic()
        assert run(make_cfg(tiny_model_dir, ds, out), backend) == EXIT_OK
        assert lingering.poll() is not None, "the run went on while the output was still held"
        assert time.monotonic() - t < 25
    finally:
        lingering.kill()
        lingering.wait()


def test_a_full_disk_at_the_lock_is_a_pause(tiny_model_dir, backend, tmp_path, monkeypatch) -> None:
    import errno

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", self.path)

    monkeypatch.setattr(OutputLock, "acquire", full)
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 2, seed=1)
    logs: list[str] = []
    assert run(make_cfg(tiny_model_dir, ds, tmp_path / "out"), backend, logs) == EXIT_PAUSED
    assert any("No space left on device" in m for m in logs), logs
