"""The sglang backend against the test-only stand-in server (real hook, real tiny-model states).

The stand-in runs each prompt through transformers alone and hands the real hook ragged, chunked
prefill batches; the backend must give back exactly what the hf backend computes for the same
sample, having checked ids and layers and cleaned up the dump files.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from extraction.backends.base import Sample
from extraction.sglang import hook

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
        assert torch.equal(g.hidden_state, want.hidden_state)
        assert torch.equal(g.aux_hidden_state, want.aux_hidden_state)
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
