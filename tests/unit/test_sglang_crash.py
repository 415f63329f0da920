"""kill -9 on the sglang path (#29): of the client mid-run, then a resume; of the (stand-in) server
mid-run, then its restart. Nothing lost (every sample once, deep-verified), nothing corrupt (the hf
backend's bf16 states, bit for bit), no orphan dumps (the dump directory empty at the end).

The server is the TEST-ONLY stand-in (tests/standin_sglang/server.py) in a process of its own,
with the real hook, --min-request-seconds so that a run lasts long enough to be killed in; the
client is `hsx extract`'s Runner in a forked child (as tests/unit/test_crash.py runs it).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from hsx_run_helpers import (
    LAYERS,
    assert_complete,
    assert_same_shards,
    load_shards,
    make_cfg,
    one_thread,  # noqa: F401  (autouse)
    run,
)

from extraction.inputs.dataset import scan_dataset
from extraction.sglang import hook
from extraction.testbed.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_OK
from hsx.index import load_index

ROOT = Path(__file__).resolve().parents[2]
N = 16
CTX = mp.get_context("fork")


class Server:
    """The stand-in in a process of its own, on a fixed port: start(), kill9(), start() again."""

    def __init__(self, model: Path, dump_dir: Path):
        self.model, self.dump_dir = model, dump_dir
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, hook.ENV_DIR: str(self.dump_dir), hook.ENV_LAYERS: LAYERS,
               "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests/standin_sglang/server.py"), "--model-path", str(self.model),
             "--port", str(self.port), "--chunked-prefill-size", "16", "--min-request-seconds", "0.15"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read().decode()[-2000:]
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise AssertionError("the stand-in server did not come up")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill9()


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("sglang-crash")
    ds = write_tiny_dataset(root / "d.jsonl", N, seed=13)
    ref = root / "ref"  # what the sglang path must give: the hf backend's bf16 states
    assert run(make_cfg(tiny_model_dir, ds, ref, dtype="bf16", batch_size=1), None) == EXIT_OK
    dump_dir = root / "dumps"
    dump_dir.mkdir()
    server = Server(tiny_model_dir, dump_dir)
    server.start()
    yield tiny_model_dir, ds, load_shards(ref), server, {e.sample_id for e in scan_dataset(ds).entries}
    server.stop()


def _client(cfg_kw: dict) -> None:
    torch.set_num_threads(1)
    os._exit(run(make_cfg(**cfg_kw), None))


def _start_client(model, ds, out, server, **kw):
    cfg_kw = dict(model=model, dataset=ds, output=out, backend="sglang", server_url=server.url,
                  dump_dir=str(server.dump_dir), dtype="bf16", concurrency=4, **kw)
    p = CTX.Process(target=_client, args=(cfg_kw,))
    p.start()
    return p


def _wait_indexed(out: Path, p, k: int) -> int:
    deadline = time.monotonic() + 60
    while len(load_index(str(out))) < k and p.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(load_index(str(out)))


def test_kill_9_of_the_client_mid_run_then_resume(setup, tmp_path: Path) -> None:
    """Killed twice (after 3 and after 9 samples); the dumps its requests in flight left behind
    are removed by the next client; the resume completes the run, bit for bit."""
    model, ds, reference, server, ids = setup
    out = tmp_path / "out"
    orphans = 0
    for k in (3, 9):
        p = _start_client(model, ds, out, server)
        assert _wait_indexed(out, p, k) < N, "the run ended before the kill"
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert p.exitcode == -signal.SIGKILL
        time.sleep(0.5)  # the server finishes the dead client's requests: their dumps land
        orphans += len([n for n in os.listdir(server.dump_dir) if n.endswith(".pt")])
    assert orphans > 0  # the kills left dumps no one will read ...
    p = _start_client(model, ds, out, server)
    p.join(120)
    assert p.exitcode == EXIT_OK
    assert_complete(out, ids)
    assert_same_shards(out, reference)
    assert os.listdir(server.dump_dir) == []  # ... and the resume removed them


def test_kill_9_of_the_server_mid_run_then_restart(setup, tmp_path: Path) -> None:
    """The server killed while the client has requests in flight, restarted 1 s later: the client
    waits for /health and asks again (a reply that had left without its dump: after the dump
    timeout, through --retries); the run completes, bit for bit, and no dump or temp is left."""
    model, ds, reference, server, ids = setup
    out = tmp_path / "out"
    p = _start_client(model, ds, out, server, dump_timeout=3.0, retries=3)
    try:
        assert _wait_indexed(out, p, 4) < N, "the run ended before the kill"
        server.kill9()
        time.sleep(1.0)
        server.start()
        p.join(180)
    finally:
        if p.is_alive():
            p.kill()
    assert p.exitcode == EXIT_OK
    assert_complete(out, ids)
    assert_same_shards(out, reference)
    assert os.listdir(server.dump_dir) == []
