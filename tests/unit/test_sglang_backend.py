"""The sglang backend against the test-only stand-in server (real hook, real tiny-model states).

The stand-in runs each prompt through transformers alone and hands the real hook ragged, chunked
prefill batches; the backend must give back exactly what the hf backend computes for the same
sample, having checked ids and layers and cleaned up the dump files.
"""

from __future__ import annotations

import ctypes
import errno
import importlib.util
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from extraction.backends.base import Sample
from extraction.sglang import hook
from extraction.shards.filebytes import in_memory

ROOT = Path(__file__).resolve().parents[2]
LAYERS = [1, 3, 4]


def _standin():
    name = "standin_sglang_server"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "standin_sglang" / "server.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return str(tiny_model_dir)


@pytest.fixture
def server(model_dir, tmp_path, monkeypatch):
    dump_dir = tmp_path / "dumps"
    monkeypatch.setenv(hook.ENV_DIR, str(dump_dir))
    monkeypatch.setenv(hook.ENV_LAYERS, ",".join(map(str, LAYERS)))
    srv = _standin().StandInServer(model_dir, chunk=16).start()
    yield srv, str(dump_dir)
    srv.stop()


def samples(lengths: list[int]) -> list[Sample]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, 1024, (n,), generator=gen)
        out.append(Sample(f"s/{i:03d}", ids, torch.ones(n, dtype=torch.long)))
    return out


def test_sglang_states_equal_hf_states(server, model_dir):
    from extraction.backends.hf import HFBackend
    from extraction.backends.sglang import SGLangBackend

    srv, dump_dir = server
    batch = samples([3, 20, 37, 16, 65, 100, 1])
    backend = SGLangBackend(srv.url, dump_dir, model_dir, LAYERS, concurrency=4, health_timeout=10)
    got = backend.extract(batch)
    backend.close()
    hf = HFBackend(model_dir, LAYERS)
    assert srv.model._hsx_dump.dumped > len(batch)  # some prompts came in several chunks
    for s, g in zip(batch, got, strict=True):
        (want,) = hf.extract([s])
        assert g.sample_id == s.sample_id and torch.equal(g.input_ids, s.input_ids)
        assert g.hidden_state.dtype == torch.bfloat16
        assert torch.equal(in_memory(g.hidden_state), want.hidden_state)
        assert torch.equal(in_memory(g.aux_hidden_state), want.aux_hidden_state)
    assert list(Path(dump_dir).iterdir()) == []  # dumps are consumed
    info = backend.model_info()
    assert (info.hidden_size, info.num_layers, info.dtype) == (64, 8, "bfloat16")


def test_layer_mismatch_is_refused(server, model_dir):
    from extraction.backends.sglang import SGLangBackend, SGLangError

    srv, dump_dir = server
    backend = SGLangBackend(srv.url, dump_dir, model_dir, [1, 2, 3], health_timeout=10)
    with pytest.raises(SGLangError, match=r"captured layers \[1, 3, 4\].*HSX_DUMP_LAYERS=1,2,3"):
        backend.extract(samples([5]))
    backend.close()


def test_waits_for_health_and_fails_clearly_without_server(server, model_dir, tmp_path):
    from extraction.backends.sglang import SGLangBackend, SGLangError

    srv, dump_dir = server
    srv.ready.clear()  # /health answers 503, as while SGLang loads
    threading.Timer(0.6, srv.ready.set).start()
    t0 = time.monotonic()
    backend = SGLangBackend(srv.url, dump_dir, model_dir, LAYERS, health_timeout=10)
    assert time.monotonic() - t0 >= 0.5
    assert len(backend.extract(samples([4]))) == 1
    backend.close()
    with pytest.raises(SGLangError, match="health not ready after 1s"):
        SGLangBackend("http://127.0.0.1:9", dump_dir, model_dir, LAYERS, health_timeout=1)


def test_missing_dump_is_an_error_not_a_hang(model_dir, tmp_path, monkeypatch):
    from extraction.backends.sglang import SGLangBackend, SGLangError

    monkeypatch.delenv(hook.ENV_DIR, raising=False)  # an unpatched / inactive server
    srv = _standin().StandInServer(model_dir).start()
    try:
        backend = SGLangBackend(
            srv.url, str(tmp_path), model_dir, LAYERS, health_timeout=10, dump_timeout=0.3
        )
        with pytest.raises(SGLangError, match="no complete dump after 0s.*is the server patched"):
            backend.extract(samples([6]))
        backend.close()
    finally:
        srv.stop()


def test_standin_min_request_seconds_is_a_floor(model_dir, tmp_path, monkeypatch):
    """The lab runs the stand-in with a floor per request (the GPU's time, CPU left free)."""
    import json
    import urllib.request

    monkeypatch.delenv(hook.ENV_DIR, raising=False)
    srv = _standin().StandInServer(model_dir, min_request_seconds=0.4).start()
    try:
        body = json.dumps({"input_ids": [5, 6, 7], "rid": "floor"}).encode()
        t = time.monotonic()
        with urllib.request.urlopen(urllib.request.Request(f"{srv.url}/generate", data=body), timeout=30) as r:
            reply = json.loads(r.read())
        assert time.monotonic() - t >= 0.4 and reply["meta_info"]["id"] == "floor"
    finally:
        srv.stop()


def test_extract_with_the_sglang_backend_publishes_through_either_publisher(server, model_dir, tmp_path):
    """`hsx extract --backend sglang` publishes through the same Publisher interface as hf: writer
    threads by default (auto), the writer process when --publisher asks for it; the same shards,
    bit for bit, every one deep-verified."""
    from hsx_run_helpers import assert_complete, assert_same_shards, load_shards, make_cfg, run

    from extraction.inputs.dataset import scan_dataset
    from extraction.testbed.tiny import write_tiny_dataset
    from hsx.exitcodes import EXIT_OK

    srv, dump_dir = server
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 6, seed=3)
    ids = {e.sample_id for e in scan_dataset(ds).entries}
    kw = dict(backend="sglang", server_url=srv.url, dump_dir=dump_dir, dtype="bf16", batch_size=3)
    logs: dict[str, list[str]] = {}
    for publisher in ("auto", "process"):
        out, logs[publisher] = tmp_path / publisher, []
        assert run(make_cfg(model_dir, ds, out, publisher=publisher, **kw), None, logs[publisher]) == EXIT_OK
        assert_complete(out, ids)
    assert not any("writer process (pid" in m for m in logs["auto"]), logs["auto"]
    assert any("writer process (pid" in m for m in logs["process"]), logs["process"]
    assert_same_shards(tmp_path / "process", load_shards(tmp_path / "auto"))


# ---------------------------------------------------------------- waiting for the dump (#29)


def _save_hook(srv, monkeypatch, before):
    """Run before(record) ahead of each save of the stand-in's hook (its writer thread): it may
    sleep (a slow disk), block, or raise (a failed write)."""
    hk = srv.model._hsx_dump
    real = hk._save

    def save(record, path):
        before(record)
        real(record, path)

    monkeypatch.setattr(hk, "_save", save)
    return hk


def _open_fds(kind: str) -> int:
    """How many of this process's file descriptors are `kind` ("anon_inode:inotify", "pipe:")."""
    count = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            count += os.readlink(fd).startswith(kind)
        except OSError:
            pass
    return count


def test_the_client_waits_for_renames_without_sleeping_and_gives_the_hf_shards(
    server, model_dir, tmp_path, monkeypatch
):
    """The hook writes well after each reply; the client waits for the renames (inotify) and never
    sleep-polls; the shards are the hf backend's, bit for bit, and no dump is left behind."""
    from hsx_run_helpers import assert_complete, assert_same_shards, load_shards, make_cfg, run

    from extraction.backends import sglang as sglang_backend
    from extraction.inputs.dataset import scan_dataset
    from extraction.sglang import dumps
    from extraction.testbed.tiny import write_tiny_dataset
    from hsx.exitcodes import EXIT_OK

    srv, dump_dir = server
    _save_hook(srv, monkeypatch, lambda record: time.sleep(0.05))  # the dump lags the reply
    sleeps: list[float] = []

    def sleep(seconds):
        sleeps.append(seconds)
        time.sleep(seconds)

    clock = SimpleNamespace(monotonic=time.monotonic, sleep=sleep)
    monkeypatch.setattr(sglang_backend, "time", clock)
    monkeypatch.setattr(dumps, "time", clock)
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 6, seed=5)
    ids = {e.sample_id for e in scan_dataset(ds).entries}
    got = tmp_path / "sglang"
    cfg = make_cfg(model_dir, ds, got, backend="sglang", server_url=srv.url, dump_dir=dump_dir, dtype="bf16")
    assert run(cfg, None) == EXIT_OK
    assert sleeps == []  # woken by the renames, never by a timer
    assert list(Path(dump_dir).iterdir()) == []
    want = tmp_path / "hf"
    assert run(make_cfg(model_dir, ds, want, dtype="bf16", batch_size=1), None) == EXIT_OK
    assert_complete(got, ids)
    assert_same_shards(got, load_shards(want))


def test_a_failed_piece_is_asked_again_at_once_with_a_new_rid_leaving_no_dump(server, model_dir, monkeypatch):
    """The hook could not write the first piece of the first attempt (its `.failed` marker); its
    later pieces land after the client gave that attempt up. The client asks again at once with a
    new rid, gets the right states, and no file of either attempt is left."""
    from extraction.backends.hf import HFBackend
    from extraction.backends.sglang import SGLangBackend, SGLangError

    srv, dump_dir = server
    rids: list[str] = []

    def before(record):
        if record["rid"] not in rids:
            rids.append(record["rid"])
        if record["rid"] == rids[0]:
            if record["offset"] == 0:
                raise OSError(28, "No space left on device")
            time.sleep(0.3)

    hk = _save_hook(srv, monkeypatch, before)
    (sample,) = samples([40])  # three prefill pieces of at most 16 tokens
    backend = SGLangBackend(srv.url, dump_dir, model_dir, LAYERS, health_timeout=10, dump_timeout=5)
    t0 = time.monotonic()
    (got,) = backend.extract([sample])
    assert time.monotonic() - t0 < 4  # at once, not after the dump timeout
    (want,) = HFBackend(model_dir, LAYERS).extract([sample])
    assert torch.equal(in_memory(got.hidden_state), want.hidden_state)
    assert torch.equal(in_memory(got.aux_hidden_state), want.aux_hidden_state)
    assert len(rids) == 2 and hk.failed == 1
    assert list(Path(dump_dir).iterdir()) == []
    # a disk that fails every write: asked 1 + write_retries times, then the sample fails
    attempts: set[str] = set()
    monkeypatch.setattr(hk, "_save", lambda record, path: attempts.add(record["rid"]) or 1 / 0)
    with pytest.raises(SGLangError, match="s/000: the server could not write its dump, 3 times"):
        backend.extract([sample])
    assert len(attempts) == 3
    assert hk.flush(30)  # every piece of the last attempt has failed: its later markers are in ...
    backend.close()
    assert list(Path(dump_dir).iterdir()) == []  # ... and removed at close


def test_a_dump_timeout_fails_the_sample_and_leaves_no_dump(server, model_dir, monkeypatch):
    """The dump disk hangs after a request's first piece: the sample fails after the dump timeout,
    the piece already written is removed at once, and the pieces that land later are removed once
    a later request's dump is in (the one writer writes in order)."""
    from extraction.backends.sglang import SGLangBackend, SGLangError

    srv, dump_dir = server
    stuck, release = threading.Event(), threading.Event()

    def before(record):
        if record["offset"] > 0 and not release.is_set():
            stuck.set()
            assert release.wait(30)

    _save_hook(srv, monkeypatch, before)
    first, later = samples([40, 5])
    backend = SGLangBackend(srv.url, dump_dir, model_dir, LAYERS, health_timeout=10, dump_timeout=0.5)
    with pytest.raises(SGLangError, match=r"s/000: no complete dump after 0s"):
        backend.extract([first])
    assert stuck.is_set()
    assert list(Path(dump_dir).iterdir()) == []  # the first piece was in place: removed
    release.set()
    assert len(backend.extract([later])) == 1
    assert list(Path(dump_dir).iterdir()) == []  # the late pieces: removed too
    backend.close()


@pytest.mark.parametrize("reply", ["dropped", "not-json"])
def test_a_lost_or_garbled_reply_leaves_no_dump(server, model_dir, monkeypatch, reply):
    """The server ran the request (its hook takes the dump) but the reply is lost (the server
    restarting: the connection closes unanswered) or not JSON. A lost reply is asked again with a
    new rid; a garbled one fails the sample. Either way no file of that rid is left."""
    from extraction.backends.sglang import SGLangBackend, SGLangError

    srv, dump_dir = server
    handler = srv.httpd.RequestHandlerClass
    real_reply = handler._reply
    spoilt: list[str] = []

    def spoil(self, code, body):
        if self.path != "/generate" or code != 200 or spoilt:
            return real_reply(self, code, body)
        spoilt.append(body["meta_info"]["id"])
        if reply == "not-json":
            data = b"<html>502 Bad Gateway</html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    monkeypatch.setattr(handler, "_reply", spoil)
    saved: list[str] = []

    def before(record):  # the spoilt request's pieces land after the client gave it up
        saved.append(record["rid"])
        if record["rid"] == saved[0]:
            time.sleep(0.3)

    _save_hook(srv, monkeypatch, before)
    one, two = samples([40, 5])
    backend = SGLangBackend(srv.url, dump_dir, model_dir, LAYERS, health_timeout=10, dump_timeout=5)
    if reply == "dropped":
        assert len(backend.extract([one])) == 1
    else:
        with pytest.raises(SGLangError, match="s/000: /generate answered 200 with a body that is not JSON"):
            backend.extract([one])
    assert len(backend.extract([two])) == 1
    backend.close()
    assert spoilt and spoilt[0] == saved[0]
    assert list(Path(dump_dir).iterdir()) == []


def test_waits_close_their_inotify_instances_and_poll_without_inotify(server, model_dir, monkeypatch):
    """One inotify instance per waiting request, closed when its wait ends (a user has 128); where
    inotify_init1 fails (no instances left) or the watch cannot be added, the wait polls instead."""
    from extraction.backends.sglang import SGLangBackend
    from extraction.sglang import dumps

    srv, dump_dir = server
    _save_hook(srv, monkeypatch, lambda record: time.sleep(0.02))
    backend = SGLangBackend(srv.url, dump_dir, model_dir, LAYERS, concurrency=4, health_timeout=10)
    batch = samples([3, 20, 37, 16, 65])
    inotify, pipes = _open_fds("anon_inode:inotify"), _open_fds("pipe:")
    want = backend.extract(batch)
    assert _open_fds("anon_inode:inotify") == inotify  # every wait closed its instance
    calls: list[str] = []

    class NoInotify:  # libc as it answers when the user's inotify instances are all taken
        def inotify_init1(self, flags):
            calls.append("init")
            ctypes.set_errno(errno.EMFILE)
            return -1

    class NoWatch:  # an instance, but the directory cannot be watched: the instance is closed
        def inotify_init1(self, flags):
            calls.append("init")
            r, w = os.pipe()
            os.close(w)
            return r

        def inotify_add_watch(self, fd, path, mask):
            ctypes.set_errno(errno.ENOSPC)
            return -1

    for libc in (NoInotify(), NoWatch()):
        calls.clear()
        monkeypatch.setattr(dumps, "_libc", lambda libc=libc: libc)
        got = backend.extract(batch)
        assert len(calls) >= len(batch)  # every wait asked for an instance, then polled
        for g, w in zip(got, want, strict=True):
            assert torch.equal(in_memory(g.hidden_state), in_memory(w.hidden_state))
            assert torch.equal(in_memory(g.aux_hidden_state), in_memory(w.aux_hidden_state))
    assert _open_fds("pipe:") == pipes  # the instances without a watch were closed
    backend.close()
    assert list(Path(dump_dir).iterdir()) == []


# ---------------------------------------------------------------------------- API key (issue #30 item 10)

KEY = "0123456789abcdef" * 4


@pytest.fixture
def keyed_server(model_dir, tmp_path, monkeypatch):
    """The stand-in demanding KEY as SGLang does with --api-key; records (method, path, Authorization)."""
    dump_dir = tmp_path / "dumps"
    monkeypatch.setenv(hook.ENV_DIR, str(dump_dir))
    monkeypatch.setenv(hook.ENV_LAYERS, ",".join(map(str, LAYERS)))
    srv = _standin().StandInServer(model_dir, chunk=16, api_key=KEY).start()
    seen: list[tuple[str, str, str | None]] = []
    handler = srv.httpd.RequestHandlerClass
    real = handler._authorized

    def record(self):
        seen.append((self.command, self.path, self.headers.get("Authorization")))
        return real(self)

    monkeypatch.setattr(handler, "_authorized", record)
    yield srv, str(dump_dir), seen
    srv.stop()


def _key_file(tmp_path, key: str) -> str:
    path = tmp_path / "sglang-api-key"
    path.write_text(key + "\n")
    path.chmod(0o600)
    return str(path)


def _call(url: str, method: str = "GET", auth: str | None = None, body: bytes | None = None) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, method=method, headers={"Authorization": auth} if auth else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_standin_enforces_the_key_as_sglang_does(keyed_server):
    """SGLang's decide_request_auth with --api-key: /health open, everything else 401 without
    `Authorization: Bearer <key>` (scheme in any case), before routing."""
    srv, _dump_dir, _seen = keyed_server
    body = b'{"input_ids": [5, 6, 7], "rid": "k"}'
    assert _call(f"{srv.url}/health") == (200, b"OK")
    assert _call(f"{srv.url}/generate", "POST", body=body) == (401, b'{"error": "Unauthorized"}')
    assert _call(f"{srv.url}/generate", "POST", "Bearer wrong", body)[0] == 401
    assert _call(f"{srv.url}/generate", "POST", f"Basic {KEY}", body)[0] == 401
    assert _call(f"{srv.url}/model_info")[0] == 401
    assert _call(f"{srv.url}/no/such/route")[0] == 401  # the key is checked before the route
    assert _call(f"{srv.url}/model_info", auth=f"bearer {KEY}")[0] == 200
    assert _call(f"{srv.url}/generate", "POST", f"Bearer {KEY}", body)[0] == 200


def test_standin_takes_the_key_from_a_config_file(tmp_path):
    """`--config F` (what roles/sglang_server passes) merged as SGLang merges it: keys first."""
    config = tmp_path / "sglang-server.yaml"
    config.write_text(f'api-key: "{KEY}"\ntrust-remote-code: true\n')
    argv = _standin().merge_config_file(["--model-path", "m", "--config", str(config), "--port", "1"])
    assert argv == ["--api-key", KEY, "--trust-remote-code", "--model-path", "m", "--port", "1"]


def test_client_sends_the_key(keyed_server, model_dir, tmp_path):
    from extraction.backends.sglang import SGLangBackend

    srv, dump_dir, seen = keyed_server
    backend = SGLangBackend(
        srv.url, dump_dir, model_dir, LAYERS, health_timeout=10, api_key_file=_key_file(tmp_path, KEY)
    )
    assert len(backend.extract(samples([5, 30]))) == 2
    backend.close()
    paths = {(m, p) for m, p, _ in seen}
    assert {("GET", "/health"), ("GET", "/model_info"), ("GET", "/server_info"), ("POST", "/generate")} <= paths
    assert {a for _, _, a in seen} == {f"Bearer {KEY}"}


def test_missing_or_wrong_key_fails_the_start_clearly(keyed_server, model_dir, tmp_path):
    """At start, on GET /model_info: no /generate is sent, nothing is retried."""
    from extraction.backends.sglang import SGLangAuthError, SGLangBackend

    srv, dump_dir, seen = keyed_server
    with pytest.raises(SGLangAuthError, match=r"HTTP 401: the server demands an API key and none was given: set api_key_file"):
        SGLangBackend(srv.url, dump_dir, model_dir, LAYERS, health_timeout=10)
    wrong = _key_file(tmp_path, "f" * 64)
    with pytest.raises(SGLangAuthError, match=rf"refused the key from {wrong}: it is not the server's"):
        SGLangBackend(srv.url, dump_dir, model_dir, LAYERS, health_timeout=10, api_key_file=wrong)
    assert [p for _, p, _ in seen].count("/model_info") == 2 and "/generate" not in [p for _, p, _ in seen]
    with pytest.raises(SGLangAuthError, match=r"api_key_file /nonexistent/key: cannot read it: No such file"):
        SGLangBackend(srv.url, dump_dir, model_dir, LAYERS, health_timeout=10, api_key_file="/nonexistent/key")


def test_key_refused_mid_run_rereads_the_file_once_then_fails_the_sample(keyed_server, model_dir, tmp_path):
    """The key replaced and the server restarted with it: the client reads the file again and goes
    on; a key still refused fails the sample at once (one request, no retry loop)."""
    from extraction.backends.sglang import SGLangAuthError, SGLangBackend

    srv, dump_dir, seen = keyed_server
    path = _key_file(tmp_path, KEY)
    backend = SGLangBackend(srv.url, dump_dir, model_dir, LAYERS, health_timeout=10, api_key_file=path)
    new = "a" * 64
    srv.api_key = new
    _key_file(tmp_path, new)
    assert len(backend.extract(samples([6]))) == 1
    srv.api_key = "b" * 64  # the file still holds `new`
    seen.clear()
    with pytest.raises(SGLangAuthError, match=r"s/000: POST /generate: .* HTTP 401: .* refused the key from"):
        backend.extract(samples([6]))
    assert [p for _, p, _ in seen] == ["/generate"]
    backend.close()
    assert list(Path(dump_dir).iterdir()) == []


def test_config_checks_the_key_file(tmp_path):
    from extraction.inputs.config import ConfigError, build_config

    base = {"model": "m", "dataset": "d", "output": "o", "backend": "sglang", "server_url": "http://x"}
    assert build_config({**base, "api_key_file": _key_file(tmp_path, KEY)}).api_key_file.endswith("sglang-api-key")
    with pytest.raises(ConfigError, match=r"api_key_file /nonexistent: cannot read it: No such file"):
        build_config({**base, "api_key_file": "/nonexistent"})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match=r"holds no usable API key"):
        build_config({**base, "api_key_file": str(empty)})


def test_a_server_with_its_radix_cache_is_refused_before_any_sample(model_dir, tmp_path, monkeypatch):
    """The stand-in as SGLang started without --disable-radix-cache (its GET /server_info says
    disable_radix_cache false): the start fails naming the flag and the server, after one health
    wait and before any /generate; the stand-in's default says true (the role's command line)."""
    from extraction.backends.sglang import SGLangBackend, SGLangError

    dump_dir = tmp_path / "dumps"
    monkeypatch.setenv(hook.ENV_DIR, str(dump_dir))
    monkeypatch.setenv(hook.ENV_LAYERS, ",".join(map(str, LAYERS)))
    srv = _standin().StandInServer(model_dir, chunk=16, radix_cache=True).start()
    seen: list[str] = []
    handler = srv.httpd.RequestHandlerClass
    real = handler._authorized
    monkeypatch.setattr(handler, "_authorized", lambda self: seen.append(self.path) or real(self))
    try:
        assert _call(f"{srv.url}/server_info") == (200, b'{"disable_radix_cache": false}')
        with pytest.raises(SGLangError) as e:
            SGLangBackend(srv.url, str(dump_dir), model_dir, LAYERS, health_timeout=10)
        assert f"{srv.url}/server_info" in str(e.value) and "--disable-radix-cache" in str(e.value)
        assert seen[1:] == ["/health", "/model_info", "/server_info"]  # one health wait, no /generate
        srv.radix_cache = False
        assert _call(f"{srv.url}/server_info") == (200, b'{"disable_radix_cache": true}')
        backend = SGLangBackend(srv.url, str(dump_dir), model_dir, LAYERS, health_timeout=10)
        assert len(backend.extract(samples([5]))) == 1
        backend.close()
    finally:
        srv.stop()
