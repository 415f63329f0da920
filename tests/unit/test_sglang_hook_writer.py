"""The dump hook's writer thread, off the forward's critical path (#29): back-pressure within the
budget, write failures, the drain at exit, and the client's wait for the renames."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from extraction.sglang import dumps, hook

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_hook_helpers import LENGTHS, Gate, _batch, _in_thread, _model, forward


def test_after_forward_returns_before_the_dump_is_written(attached, states, monkeypatch):
    model, out = attached
    hk = model._hsx_dump
    gate = Gate(hk, monkeypatch)
    batch, final, aux = _batch([("hsx-req-a", 0, 5), ("hsx-req-b", 0, 7)], states)
    t, result = _in_thread(hk.after_forward, batch, final, aux)
    try:
        t.join(5)
        assert not t.is_alive(), "after_forward waited for the write"
        assert result["value"] == []
        assert gate.entered.wait(5)  # the writer has it, in its own thread
        assert not list(out.glob("*.pt"))  # nothing visible until complete
    finally:
        gate.open.set()
    assert hk.flush(30)
    assert dumps.read_request(str(out), "hsx-req-a", expected_len=5).pieces == 1
    assert hk.dumped == 2 and hk.stats()["held_bytes"] == 0


def test_full_budget_makes_after_forward_wait_and_drops_nothing(tmp_path, states, monkeypatch):
    model = _model()
    # one pass of 5 + 7 tokens (hidden 64, 3 layers, bf16 + int64 ids) fits; two do not
    hk = hook.attach(model, {hook.ENV_DIR: str(tmp_path), hook.ENV_LAYERS: "1,3,4", hook.ENV_BUDGET: "0.01"})
    assert hk is not None and hk.budget == int(0.01 * 2**20)
    gate = Gate(hk, monkeypatch)
    b1, f1, a1 = _batch([("hsx-req-a", 0, 5), ("hsx-req-b", 0, 7)], states)
    b2, f2, a2 = _batch([("hsx-req-b", 7, 17), ("hsx-req-c", 0, 9)], states)
    hk.after_forward(b1, f1, a1)  # room for it: returns at once
    assert gate.entered.wait(5)
    held = hk.stats()["held_bytes"]
    assert 0 < held <= hk.budget < 2 * held
    t, _ = _in_thread(hk.after_forward, b2, f2, a2)
    t.join(0.5)
    assert t.is_alive(), "the second pass must wait for room (back-pressure)"
    gate.open.set()
    t.join(30)
    assert not t.is_alive()
    assert hk.flush(30)
    for rid, n in LENGTHS.items():  # every piece of both passes written, none dropped
        got = dumps.read_request(str(tmp_path), rid, expected_len=n)
        assert torch.equal(got.hidden_state, states[rid][1][-1])
    assert hk.dumped == 4 and hk.failed == 0 and hk.stats()["waited_s"] > 0.3
    assert hk.stats()["held_bytes"] == 0
    # a pass larger than the whole budget still goes, alone
    big = hook.attach(
        _model(), {hook.ENV_DIR: str(tmp_path / "big"), hook.ENV_LAYERS: "1,3,4", hook.ENV_BUDGET: "0.001"}
    )
    big.after_forward(b1, f1, a1)
    assert big.flush(30) and big.dumped == 2


def test_budget_setting_is_checked(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(hook, "_logged", set())
    env = {hook.ENV_DIR: str(tmp_path), hook.ENV_LAYERS: "1,3,4"}
    assert hook.attach(_model(), env).budget == hook.DEFAULT_BUDGET_MB * 2**20
    with caplog.at_level(logging.WARNING, logger="hsx_dump_hook"):
        assert hook.attach(_model(), {**env, hook.ENV_BUDGET: "lots"}) is None
    assert "HSX_DUMP_BUDGET_MB='lots' is not a number" in caplog.text


def test_write_failures_are_logged_and_the_dump_missing(attached, states, caplog, monkeypatch):
    model, out = attached
    hk = model._hsx_dump
    monkeypatch.setattr(hook, "_logged", set())
    batch, final, aux = _batch([("hsx-req-a", 0, 5)], states)
    with caplog.at_level(logging.WARNING, logger="hsx_dump_hook"):
        shutil.rmtree(out)  # the dump directory removed under the server
        assert hk.after_forward(batch, final, aux) == []
        assert hk.flush(30)
        assert "dump hsx-req-a.000000000.pt not written: FileNotFoundError: [Errno 2]" in caplog.text
        out.mkdir()
        assert not list(out.iterdir())  # neither a dump nor a marker: the client times out, asks again
        with pytest.raises(dumps.DumpError, match="no dump"):
            dumps.read_request(str(out), "hsx-req-a", expected_len=5)

        def disk_full(record, path):
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(hk, "_save", disk_full)
        batch, final, aux = _batch([("hsx-req-b", 0, 7), ("hsx-req-c", 0, 9)], states)
        assert hk.after_forward(batch, final, aux) == []
        assert hk.flush(30)
    assert hk.failed == 3 and hk.dumped == 0
    assert sorted(p.name for p in out.iterdir()) == ["hsx-req-b.000000000.failed", "hsx-req-c.000000000.failed"]
    with pytest.raises(dumps.DumpError, match="could not write this piece.*No space left on device"):
        dumps.read_request(str(out), "hsx-req-b", expected_len=7)
    t0 = time.monotonic()
    with pytest.raises(dumps.DumpWriteFailed, match="could not write"):
        dumps.wait_request(str(out), "hsx-req-c", expected_len=9, timeout=20)
    assert time.monotonic() - t0 < 5  # a marker ends the wait at once
    assert dumps.remove_request(str(out), "hsx-req-b") == 1 and dumps.remove_request(str(out), "hsx-req-c") == 1
    monkeypatch.undo()  # the writer survived its failures: the next dump is written
    forward(model, [("hsx-req-a", 0, 5)], states, "list")
    assert dumps.read_request(str(out), "hsx-req-a", expected_len=5).pieces == 1



_EXIT_SCRIPT = r"""
import importlib.util, sys, time, types, torch
spec = importlib.util.spec_from_file_location("hsx_dump_hook", sys.argv[1])  # the one deployed file
hook = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hook)
model = types.SimpleNamespace(config=types.SimpleNamespace(num_hidden_layers=6), layers_to_capture=[])
hk = hook.attach(model, {"HSX_DUMP_DIR": sys.argv[2], "HSX_DUMP_LAYERS": "1,3,4"})
real = hk._save
def slow(record, path):
    time.sleep(0.25)
    real(record, path)
hk._save = slow
for i in range(4):
    batch = types.SimpleNamespace(forward_mode=types.SimpleNamespace(name="EXTEND"), rids=[f"hsx-r{i}"],
                                  extend_seq_lens_cpu=[64], extend_prefix_lens_cpu=[0], input_ids=torch.arange(64))
    hk.after_forward(batch, torch.full((64, 64), float(i)), [torch.full((64, 64), float(i))] * 3)
print("taken", hk.dumped, flush=True)
if sys.argv[3] == "hang":
    time.sleep(120)
"""


def test_writer_drains_at_exit_and_a_kill_loses_only_dumps_in_flight(tmp_path):
    """Daemon writer + atexit drain: a normal exit writes everything taken; SIGKILL loses what was
    in flight, never leaving a partial dump under a final name."""
    script = tmp_path / "server.py"
    script.write_text(_EXIT_SCRIPT)
    drained = tmp_path / "drained"
    proc = subprocess.run(
        [sys.executable, str(script), hook.__file__, str(drained), "exit"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "taken 0"  # all four taken before any was written ...
    for i in range(4):  # ... and all four written before the interpreter was gone
        got = dumps.read_request(str(drained), f"hsx-r{i}", expected_len=64)
        assert torch.equal(got.hidden_state, torch.full((64, 64), float(i)))
    assert sorted(p.name for p in drained.iterdir()) == [f"hsx-r{i}.000000000.pt" for i in range(4)]

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, str(script), hook.__file__, str(killed), "hang"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().startswith("taken")
        deadline = time.monotonic() + 30
        while not (killed / "hsx-r0.000000000.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finals = sorted(p.name for p in killed.glob("*.pt"))
    assert "hsx-r0.000000000.pt" in finals and len(finals) < 4  # in-flight dumps lost ...
    for name in finals:  # ... but every dump in place is whole
        dumps.read_request(str(killed), name.split(".")[0], expected_len=64)
    assert all(p.name.startswith(".") for p in killed.iterdir() if not p.name.endswith(".pt"))


def test_wait_request_wakes_on_the_rename_and_times_out(attached, states, monkeypatch):
    model, out = attached
    hk = model._hsx_dump
    watch = dumps._DirWatch(str(out))
    assert watch.ok  # inotify on this machine: the wait below is woken, not polled
    watch.close()
    gate = Gate(hk, monkeypatch)
    batch, final, aux = _batch([("hsx-req-b", 0, 7)], states)
    hk.after_forward(batch, final, aux)
    batch, final, aux = _batch([("hsx-req-b", 7, 17)], states)
    hk.after_forward(batch, final, aux)
    t, result = _in_thread(dumps.wait_request, str(out), "hsx-req-b", 17, 30.0)
    t.join(0.3)
    assert t.is_alive()  # both pieces taken, none written yet
    gate.open.set()
    t.join(30)
    got = result["value"]
    assert got.pieces == 2 and torch.equal(got.hidden_state, states["hsx-req-b"][1][-1])
    t0 = time.monotonic()
    with pytest.raises(dumps.DumpError, match=r"no dump for request 'hsx-req-x'.*\(waited 0.3s\)"):
        dumps.wait_request(str(out), "hsx-req-x", 5, timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 3
    monkeypatch.setattr(dumps._DirWatch, "ok", property(lambda self: False))  # no inotify: polls
    forward(model, [("hsx-req-a", 0, 5)], states, "list", flush=False)
    assert dumps.wait_request(str(out), "hsx-req-a", 5, timeout=30).pieces == 1



def test_wait_request_works_with_a_descriptor_above_1023(tmp_path):
    """A busy client has many files open; select() refuses a descriptor above 1023, poll() not."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while not held or held[-1] < 1030:
            held.append(os.open(os.devnull, os.O_RDONLY))
        watch = dumps._DirWatch(str(tmp_path))
        try:
            assert watch.ok and watch.fd > 1023
            assert watch.wait("hsx-req-z.", 0.05) is False  # times out, no ValueError
            os.rename(_touch(tmp_path / "x.tmp"), tmp_path / "hsx-req-z.000000000.pt")
            assert watch.wait("hsx-req-z.", 5) is True
        finally:
            watch.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _touch(path):
    path.write_bytes(b"")
    return path


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "-inf", "1e400", "many"])
def test_budget_refuses_what_is_not_a_finite_positive_number(text):
    with pytest.raises(ValueError, match=hook.ENV_BUDGET):
        hook.parse_budget(text)


def test_budget_is_mib():
    assert hook.parse_budget("512") == 512 * 2**20
    assert hook.parse_budget("0.5") == 2**19
