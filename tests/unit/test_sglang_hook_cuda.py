"""The dump hook's CUDA path with torch.cuda faked (sglang_hook_helpers.FakeCuda: no GPU here):
copies on a side stream into pinned memory, the writer waiting for them, the budget's room."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from extraction.sglang import dumps, hook

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_hook_helpers import (
    LAYERS,
    LENGTHS,
    FakeCuda,
    Gate,
    Turnstile,
    _in_thread,
    _model,
    _on_device,
)


def test_cuda_path_copies_on_a_side_stream_and_the_writer_waits_for_them(attached, states, monkeypatch):
    model, out = attached
    hk = model._hsx_dump
    cuda = FakeCuda(monkeypatch)
    cuda.capturing = True  # a CUDA graph being captured: not dumped, nothing taken
    assert hk.after_forward(*_on_device([("hsx-req-a", 0, 5)], states)) == []
    assert hk.flush(30) and not cuda.calls and not list(out.iterdir()) and hk.stats()["held_bytes"] == 0
    cuda.capturing = False
    gate = Gate(hk, monkeypatch)
    batch, final, aux = _on_device([("hsx-req-a", 0, 5), ("hsx-req-b", 0, 7)], states)
    sources = [final, batch.input_ids, *aux]
    assert hk.after_forward(batch, final, aux) == []
    assert gate.entered.wait(5)  # the writer is saving the first piece
    side = hk._streams[final.device]
    want = [("wait_stream", "forward-stream")]  # the side stream waits for the forward's first
    for t in sources:  # each source copied whole into pinned memory, and kept from reuse until copied
        want += [("copy", t.data_ptr()), ("record_stream", t.data_ptr(), side)]
    want += [("event", True), ("record", side)]  # a blocking event after the copies
    writer = "hsx-dump-writer"  # which sets the device, then waits for the event, then writes
    want += [("set_device", final.device, writer), ("synchronize", writer)]
    # first, on the side stream, the rows' finiteness (hsx_dump_format.rows_finite: made there, so no
    # record_stream) copied into pinned memory of its own, then the sources
    finite_copy = cuda.calls.pop(1)
    assert finite_copy[0] == "copy" and finite_copy[1] not in [t.data_ptr() for t in sources]
    assert cuda.calls == want
    assert cuda.pinned == [(final.shape[0],)] + [tuple(t.shape) for t in sources]
    assert cuda.ran == len(sources) + 1  # every copy had run before the first save
    assert torch.equal(gate.records[0]["hidden_state"], states["hsx-req-a"][1][-1])
    gate.open.set()
    assert hk.flush(30) and hk.failed == 0 and hk.stats()["held_bytes"] == 0
    for rid, n in (("hsx-req-a", 5), ("hsx-req-b", 7)):
        got = dumps.read_request(str(out), rid, expected_len=n)
        hs = states[rid][1]
        assert torch.equal(got.hidden_state, hs[-1][:n])
        assert torch.equal(got.aux_hidden_state, torch.cat([hs[i][:n] for i in LAYERS], dim=-1))
        assert got.input_ids.dtype == torch.long and torch.equal(got.input_ids, states[rid][0][:n])


def test_cuda_path_waits_for_room_and_an_oversize_pass_goes_alone(tmp_path, states, monkeypatch):
    FakeCuda(monkeypatch)
    # 520 bytes a token (bf16 final state, int64 id, 3 bf16 aux layers of 64) in 8388 bytes of budget
    env = {hook.ENV_DIR: str(tmp_path), hook.ENV_LAYERS: "1,3,4", hook.ENV_BUDGET: "0.008"}
    hk = hook.attach(_model(), env)
    turn = Turnstile(hk, monkeypatch)
    held = lambda: hk.stats()["held_bytes"]  # noqa: E731
    a = _on_device([("hsx-req-a", 0, 5), ("hsx-req-b", 0, 7)], states)  # 6240 bytes
    c = _on_device([("hsx-req-a", 0, 5)], states, rids=["hsx-late-a"])  # 2600: fits, but not beside a
    big = _on_device([("hsx-req-b", 7, 17), ("hsx-req-c", 0, 9)], states)  # 9880: more than the budget
    d = _on_device([("hsx-req-c", 0, 9)], states, rids=["hsx-late-c"])  # 4680
    assert hk.after_forward(*a) == []  # room: returns at once
    assert turn.entered.acquire(timeout=5) and held() == 6240
    t, _ = _in_thread(hk.after_forward, *c)
    t.join(0.3)
    assert t.is_alive() and held() == 6240  # back-pressure
    turn.let(2)  # a written: c goes
    t.join(5)
    assert not t.is_alive() and turn.entered.acquire(timeout=5) and held() == 2600
    t, _ = _in_thread(hk.after_forward, *big)
    t.join(0.3)
    assert t.is_alive() and held() == 2600  # the oversize pass waits until nothing is in flight ...
    turn.let(1)
    t.join(5)
    assert not t.is_alive() and turn.entered.acquire(timeout=5) and held() == 9880  # ... then goes alone
    t, _ = _in_thread(hk.after_forward, *d)
    t.join(0.3)
    assert t.is_alive() and held() == 9880  # nothing beside it
    turn.let(3)
    t.join(5)
    assert not t.is_alive()
    assert hk.flush(30) and hk.dumped == 6 and hk.failed == 0 and held() == 0
    assert hk.stats()["waited_s"] > 0.9
    written = {"hsx-req-a": "hsx-req-a", "hsx-req-b": "hsx-req-b", "hsx-req-c": "hsx-req-c", "hsx-late-a": "hsx-req-a", "hsx-late-c": "hsx-req-c"}
    for rid, src in written.items():
        got = dumps.read_request(str(tmp_path), rid, expected_len=LENGTHS[src])
        assert torch.equal(got.hidden_state, states[src][1][-1]), rid


def test_cuda_copy_failure_gives_the_room_back(tmp_path, states, monkeypatch, caplog):
    cuda = FakeCuda(monkeypatch)
    monkeypatch.setattr(hook, "_logged", set())
    env = {hook.ENV_DIR: str(tmp_path), hook.ENV_LAYERS: "1,3,4", hook.ENV_BUDGET: "0.008"}
    hk = hook.attach(_model(), env)
    a = _on_device([("hsx-req-a", 0, 5), ("hsx-req-b", 0, 7)], states)  # 6240 bytes: two do not fit together
    cuda.fail_pinned_at = 2  # the first aux part's pinned memory, after two copies were queued
    with caplog.at_level(logging.WARNING, logger="hsx_dump_hook"):
        assert hk.after_forward(*a) == []  # never raises into SGLang
    assert "batch skipped: cudaHostAlloc failed" in caplog.text
    assert len(cuda.queued) == 2 and hk.stats()["held_bytes"] == 0
    t, result = _in_thread(hk.after_forward, *a)  # had the room not come back, this would wait forever
    t.join(5)
    assert not t.is_alive() and result["value"] == []
    assert hk.flush(30) and hk.dumped == 2 and hk.failed == 0 and hk.stats()["held_bytes"] == 0
    assert torch.equal(
        dumps.read_request(str(tmp_path), "hsx-req-b", expected_len=7).hidden_state, states["hsx-req-b"][1][-1][:7]
    )


