"""kill -9 at random points, then resume: every sample exactly once, deep-verified, bit-identical.

Each run is a forked child of this process (the model is loaded once, before the fork), so a
trial costs a fraction of a second instead of a fresh interpreter. Half the kills are timed at
random; the other half fire inside the writer's commit protocol at a random system call
(before or after a rename, between shard and index, or in the middle of an index line).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from hsx_run_helpers import (
    SharedBackend,
    assert_complete,
    load_shards,
    make_cfg,
    one_thread,  # noqa: F401  (autouse)
    run,
)

from extraction.backends.hf import HFBackend
from extraction.inputs.dataset import scan_dataset
from extraction.publish import writerproc
from extraction.testbed.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_OK, EXIT_SIGINT, EXIT_SIGTERM
from hsx.index import load_index
from hsx.layout import SHARD_KEYS
from hsx.status import read_status
from hsx.verify.scan import scan_shards

N = 12
TRIALS = 10
CTX = mp.get_context("fork")


def _child(
    cfg_kw: dict, backend: SharedBackend, inject: tuple[str, int] | None, writer: str = "process"
) -> None:
    torch.set_num_threads(1)  # also required after fork: the parent's OpenMP pool is gone
    if inject is not None:
        _arm(*inject, writer)
    os._exit(run(make_cfg(**cfg_kw, publisher=writer), backend))


def _arm(call: str, at: int, writer: str) -> None:
    """SIGKILL the runner at the `at`-th call of os.<call> by whoever publishes the shards (its
    writer process, or the runner itself with writer threads); 'tear' writes half an index line
    first. The writer process dies with it, as a node going down takes both.

    Only the publisher's calls count: the runner's tokenizer process inherits the wrapper too (its
    writes are its messages), and so does the runner beside a writer process (status, pipes)."""
    count = {"n": 0}
    name = "write" if call == "tear" else call
    real = getattr(os, name)
    runner_pid = os.getpid()

    def publishing() -> bool:
        if writer == "process":
            return writerproc.in_writer_process()
        return os.getpid() == runner_pid

    def wrapper(*args, **kwargs):
        if not publishing():
            return real(*args, **kwargs)
        count["n"] += 1
        if count["n"] == at:
            if call == "tear":
                fd, data = args[0], bytes(args[1])
                real(fd, data[: max(1, len(data) // 2)])
            os.kill(runner_pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    setattr(os, name, wrapper)


def _start(cfg_kw: dict, backend: SharedBackend, inject=None, writer: str = "process"):
    p = CTX.Process(target=_child, args=(cfg_kw, backend, inject, writer))
    p.start()
    return p


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("crash")
    ds = write_tiny_dataset(root / "d.jsonl", N, seed=11)
    backend = SharedBackend(HFBackend(tiny_model_dir, [1, 3, 4], dtype="fp32"))
    kw = dict(model=tiny_model_dir, dataset=ds, max_length=32, batch_size=3, status_interval=0.05)
    ref = root / "ref"
    t0 = time.monotonic()
    p = _start({**kw, "output": ref}, backend)
    p.join(120)
    assert p.exitcode == EXIT_OK
    return kw, backend, ref, time.monotonic() - t0, {e.sample_id for e in scan_dataset(ds).entries}


def test_kill_9_at_random_points_then_resume(setup, tmp_path: Path) -> None:
    kw, backend, ref, duration, ids = setup
    reference = load_shards(ref)
    rng = random.Random(1234)
    killed = 0
    for trial in range(TRIALS):
        out = tmp_path / f"t{trial}"
        cfg_kw = {**kw, "output": out}
        kills = 2 if trial % 3 == 0 else 1
        writer = "thread" if trial % 5 == 4 else "process"  # the sglang backend's writer threads too
        for _ in range(kills):
            if trial % 2:
                call = rng.choice(["replace", "fsync", "write", "tear"])
                # calls per sample: 1 replace, 2-3 fsyncs, 1 index write
                at = rng.randint(1, {"replace": N // 2, "fsync": N, "write": N // 2, "tear": N // 2}[call])
                p = _start(cfg_kw, backend, (call, at), writer)
                p.join(120)
            else:
                # A random moment of the write phase: after k samples are indexed, plus a jitter.
                p = _start(cfg_kw, backend, writer=writer)
                k = rng.randint(0, N - 2)
                while len(load_index(str(out))) <= k and p.is_alive():
                    time.sleep(0.002)
                time.sleep(rng.uniform(0, 0.03))
                os.kill(p.pid, signal.SIGKILL)
                p.join(120)
            killed += p.exitcode == -signal.SIGKILL
            print(f"trial {trial} ({writer}): exit {p.exitcode}, {len(load_index(str(out)))} indexed")
        p = _start(cfg_kw, backend)
        p.join(120)
        assert p.exitcode == EXIT_OK, f"trial {trial}: resume exited {p.exitcode}"
        assert_complete(out, ids)
        got = load_shards(out)
        for sid in ids:
            for key in SHARD_KEYS:
                assert torch.equal(got[sid][key], reference[sid][key]), (trial, sid, key)
        if trial < TRIALS - 1:
            shutil.rmtree(out)
    assert killed >= TRIALS  # the kills really happened mid-run (not after a finished run)


def _slow_tokenizer() -> None:
    """Keep the runner's tokenizer process alive for a while (0.3 s a sample)."""
    from extraction.inputs.chat_tokenizer import ChatTokenizer

    real = ChatTokenizer.encode

    def encode(self, conv):
        time.sleep(0.3)
        return real(self, conv)

    ChatTokenizer.encode = encode


def _slow_child(cfg_kw: dict, backend: SharedBackend) -> None:
    """A run whose tokenizer process is still at work when its first shards are indexed:
    windows of 4 samples, each taking the tokenizer 1.2 s."""
    from extraction.runner import plan

    _slow_tokenizer()
    plan.WINDOW_BATCHES = 4
    _child(cfg_kw, backend, None)


@pytest.mark.parametrize("group", [False, True], ids=["runner", "whole-group"])
@pytest.mark.parametrize(
    ("sig", "code", "state"),
    [(signal.SIGTERM, EXIT_SIGTERM, "interrupted"), (signal.SIGINT, EXIT_SIGINT, "interrupted")],
)
def test_signal_stops_cleanly(setup, tmp_path: Path, sig, code, state, group) -> None:
    """The signal to the runner alone, or first to its tokenizer process and then to it, as
    `systemctl stop` (the whole control group) and a Ctrl-C (the process group) send it."""
    kw, backend, _ref, _duration, ids = setup
    out = tmp_path / "out"
    cfg_kw = {**kw, "output": out, "batch_size": 1}
    p = CTX.Process(target=_slow_child, args=(cfg_kw, backend)) if group else _start(cfg_kw, backend)
    if group:
        p.start()
    deadline = time.monotonic() + 60
    while not load_index(str(out)) and time.monotonic() < deadline:
        time.sleep(0.01)
    if group:
        children = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
        assert children, "the tokenizer process should still be running"
        for child in children:
            os.kill(int(child), sig)
        time.sleep(0.2)
    os.kill(p.pid, sig)
    p.join(60)
    assert p.exitcode == code
    assert read_status(str(out))["state"] == state
    index = load_index(str(out))
    assert 0 < len(index) < N
    assert sorted(scan_shards(str(out))) == sorted(e.path for e in index.values())
    p = _start({**kw, "output": out, "batch_size": 1}, backend)
    p.join(120)
    assert p.exitcode == EXIT_OK
    assert_complete(out, ids)
