"""The streaming client (#29 item 3): a window of requests always in flight, no per-batch barrier,
each sample published as soon as its dump is in, done samples never sent again; what a crash
leaves in the dump directory removed by the next client.

Against the TEST-ONLY stand-in server (tests/standin_sglang/server.py) with the real hook.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from hsx_run_helpers import assert_complete, assert_same_shards, load_shards, make_cfg, run
from test_sglang_backend import LAYERS, _standin, samples

from extraction.inputs.dataset import scan_dataset
from extraction.sglang import dumps, hook
from extraction.testbed.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_OK
from hsx.index import load_index


@pytest.fixture
def server(tiny_model_dir, tmp_path, monkeypatch):
    dump_dir = tmp_path / "dumps"
    monkeypatch.setenv(hook.ENV_DIR, str(dump_dir))
    monkeypatch.setenv(hook.ENV_LAYERS, ",".join(map(str, LAYERS)))
    srv = _standin().StandInServer(str(tiny_model_dir), chunk=16).start()
    yield srv, str(dump_dir)
    srv.stop()


def _watch_generate(srv, monkeypatch, hold=None):
    """Count /generate requests in the server at once (max), and all of them; `hold(n)` runs in
    the handler of the n-th request (1-based) before its reply leaves."""
    handler = srv.httpd.RequestHandlerClass
    real = handler.do_POST
    lock = threading.Lock()
    seen = {"now": 0, "max": 0, "all": 0}

    def do_post(self):
        with lock:
            seen["now"] += 1
            seen["all"] += 1
            seen["max"] = max(seen["max"], seen["now"])
            n = seen["all"]
        try:
            if hold is not None:
                hold(n)
            return real(self)
        finally:
            with lock:
                seen["now"] -= 1

    monkeypatch.setattr(handler, "do_POST", do_post)
    return seen


def test_a_slow_request_holds_back_no_other_and_the_window_stays_full(server, tiny_model_dir, tmp_path, monkeypatch):
    """The first request is held at the server; with planned batches of 2 and a window of 3, the
    samples behind it (of later batches) are sent, dumped and published while it waits, with
    never more than 3 requests in flight. The shards are the hf backend's, bit for bit."""
    srv, dump_dir = server
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 8, seed=5)
    ids = {e.sample_id for e in scan_dataset(ds).entries}
    out = tmp_path / "sglang"
    published_while_held: list[int] = []

    def hold(n):
        if n != 1:
            return
        deadline = time.monotonic() + 10
        while len(load_index(str(out))) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        published_while_held.append(len(load_index(str(out))))

    seen = _watch_generate(srv, monkeypatch, hold)
    cfg = make_cfg(
        tiny_model_dir, ds, out, backend="sglang", server_url=srv.url, dump_dir=dump_dir, dtype="bf16",
        batch_size=2, concurrency=3,
    )
    assert run(cfg, None) == EXIT_OK
    assert published_while_held[0] >= 5  # a round barrier would have published none: its batch waits
    assert seen["max"] == 3 and seen["all"] == 8  # the window, full and never exceeded; each sample once
    assert sorted(os.listdir(dump_dir)) == []
    want = tmp_path / "hf"
    assert run(make_cfg(tiny_model_dir, ds, want, dtype="bf16", batch_size=1), None) == EXIT_OK
    assert_complete(out, ids)
    assert_same_shards(out, load_shards(want))


def test_a_resumed_run_sends_only_what_is_not_done(server, tiny_model_dir, tmp_path, monkeypatch):
    srv, dump_dir = server
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 6, seed=6)
    out = tmp_path / "out"
    kw = dict(backend="sglang", server_url=srv.url, dump_dir=dump_dir, dtype="bf16", batch_size=4)
    seen = _watch_generate(srv, monkeypatch)
    assert run(make_cfg(tiny_model_dir, ds, out, limit=3, **kw), None) == EXIT_OK
    assert seen["all"] == 3
    assert run(make_cfg(tiny_model_dir, ds, out, **kw), None) == EXIT_OK
    assert seen["all"] == 6  # the 3 done were not sent again
    assert_complete(out, {e.sample_id for e in scan_dataset(ds).entries})


def test_failures_are_retried_per_sample_and_recorded_alone(server, tiny_model_dir, tmp_path, monkeypatch):
    """One sample's requests always fail (HTTP 500): it is tried 1 + --retries times and recorded
    in errors.jsonl; the others are published."""
    import json

    srv, dump_dir = server
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 5, seed=7)
    out = tmp_path / "out"
    handler = srv.httpd.RequestHandlerClass
    real = handler._reply
    bad: list[str] = []

    def reply(self, code, body):
        if self.path == "/generate" and code == 200:
            rid = body["meta_info"]["id"]
            if not bad or rid.rsplit("-", 1)[0] == bad[0]:
                bad[:1] = [rid.rsplit("-", 1)[0]]
                return real(self, 500, {"error": "injected"})
        return real(self, code, body)

    monkeypatch.setattr(handler, "_reply", reply)
    cfg = make_cfg(
        tiny_model_dir, ds, out, backend="sglang", server_url=srv.url, dump_dir=dump_dir, dtype="bf16",
        retries=2, concurrency=2,
    )
    assert run(cfg, None) != EXIT_OK  # a sample missing
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert len(errors) == 1 and errors[0]["attempts"] == 3 and "HTTP 500" in errors[0]["reason"]
    assert len(load_index(str(out))) == 4
    assert sorted(os.listdir(dump_dir)) == []


def test_what_a_crash_left_is_removed_by_the_next_client_only(server, tiny_model_dir, tmp_path):
    """A killed client's dumps and markers (another client token) and a killed server's temps (a
    dead pid) go at the next client's start; a live server's temps, other users' files and, while
    another client holds the directory, anything of another client are left alone."""
    import subprocess

    from extraction.backends.sglang import SGLangBackend

    srv, dump_dir = server
    os.makedirs(dump_dir, exist_ok=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = [
        "hsx-0badc0de-s_000-0123456789ab.000000000.pt",
        "hsx-0badc0de-s_000-0123456789ab.000000016.failed",
        f".hsx-0badc0de-s_001-0123456789ab.000000000.pt.{dead.pid}.tmp",
    ]
    kept = [
        f".hsx-0badc0de-s_002-0123456789ab.000000000.pt.{os.getpid()}.tmp",  # a live server's
        "someone-else.000000000.pt",
        f".someone-else.000000000.pt.{dead.pid}.tmp",
    ]
    for name in stale + kept:
        Path(dump_dir, name).write_bytes(b"x")
    holder = SGLangBackend(srv.url, dump_dir, str(tiny_model_dir), LAYERS, health_timeout=10)
    assert sorted(os.listdir(dump_dir)) == sorted(kept)
    for name in stale:
        Path(dump_dir, name).write_bytes(b"x")
    second = SGLangBackend(srv.url, dump_dir, str(tiny_model_dir), LAYERS, health_timeout=10)
    assert len(second.extract(samples([9]))) == 1
    second.close()
    assert sorted(os.listdir(dump_dir)) == sorted(stale + kept)  # the lock is held: not its to remove
    holder.close()
    fd = dumps.client_lock(dump_dir)
    assert fd is not None  # released at close
    os.close(fd)
