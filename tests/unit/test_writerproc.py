"""The writer process: its shared buffer, its protocol, and the runner when it fails or dies."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from hsx_run_helpers import (
    SharedBackend,
    assert_same_shards,
    load_shards,
    make_cfg,
    one_thread,  # noqa: F401  (autouse)
    run,
)
from shard_helpers import manifest, tensors

from extraction.backends.hf import HFBackend
from extraction.publish.diskguard import DiskGuard
from extraction.publish.publisher import BatchPublisher
from extraction.publish.writerproc import (
    ALIGN,
    FLAG_ABANDON,
    HEADER,
    Arena,
    ArenaFull,
    WireItem,
    WriterGone,
    WriterProcess,
    copy_into,
)
from extraction.runner import Runner, publish_process
from extraction.runner.publish_process import ProcessPublisher
from extraction.shards import ShardWriter
from extraction.shards.verify import verify_output
from extraction.testbed.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_FAILED, EXIT_OK
from hsx.index import load_index
from hsx.layout import INDEX_NAME, shard_relpath
from hsx.status import read_status

N = 16


# ------------------------------------------------------------------ the arena


def test_arena_allocates_in_a_ring_and_reuses_freed_space() -> None:
    a = Arena(4 * 1024)
    x, y, z = a.alloc(1000), a.alloc(1000), a.alloc(1000)
    assert (x, y, z) == (HEADER, HEADER + 1024, HEADER + 2048)  # ALIGN-ed, in order
    assert a.alloc(1024) == HEADER + 3072  # exactly full now
    a.free(y)  # freed out of order: the oldest block still holds the space
    assert a.in_use() == 4096
    a.free(x)  # now the two oldest are gone: 2048 bytes at the start are free again
    assert a.alloc(2048) == HEADER  # wrapped around
    with pytest.raises(ValueError, match="do not fit the writer's buffer of 4096 bytes"):
        a.alloc(4097)


def test_arena_takes_back_the_newest_block_too_and_splits_into_two_rings() -> None:
    """A block freed at the newest end comes back at once (a part sent early while a later
    batch still holds the oldest block); once split, the device's ring full of batches not
    sent yet does not stop the courier's ring, and each waits only on its own."""
    a = Arena(4 * 1024)
    oldest, new = a.alloc(1024), a.alloc(1024)
    a.free(new)
    assert a.alloc(2048) == new == oldest + 1024  # right after the oldest, not blocked behind it
    b = Arena(4 * 1024)
    b.split(0.75)
    d1 = b.empty([((256,), torch.float32)])[1]  # 1 KiB: the device's ring holds 3
    b.empty([((512,), torch.float32)])
    with pytest.raises(ArenaFull):  # full, nothing sent
        b.empty([((256,), torch.float32)])
    assert b.alloc(1024) == HEADER + 3072  # the courier's ring: its own KiB
    with pytest.raises(ValueError, match="of 1024 bytes"):
        b.alloc(2048)
    b.free(d1)
    assert b.empty([((256,), torch.float32)])[1] == HEADER


def test_arena_alloc_waits_for_a_free_and_wakes_with_writergone_on_close() -> None:
    a = Arena(2 * ALIGN)
    first = a.alloc(ALIGN)
    second = a.alloc(ALIGN)
    with pytest.raises(ArenaFull):  # nothing in use was sent to the writer: waiting would not end
        a.alloc(ALIGN)
    a.mark_sent([first])  # now the writer's outcome will free it: worth waiting for
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(a.alloc(ALIGN)))
    t.start()
    time.sleep(0.1)
    assert got == [] and t.is_alive()  # full: it waits
    a.free(first)
    t.join(5)
    assert got == [HEADER]
    a.mark_sent([second, HEADER])
    t = threading.Thread(target=lambda: got.append(pytest.raises(WriterGone, a.alloc, ALIGN)))
    t.start()
    time.sleep(0.1)
    a.close("the writer process died")
    t.join(5)
    assert not t.is_alive() and "died" in str(got[-1].value)


def test_arena_views_are_shared_with_a_forked_process() -> None:
    a = Arena(1 << 16)
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    u = torch.ones(5, dtype=torch.bfloat16)
    block, (off, uoff) = copy_into(a, t, u)
    assert block == off == HEADER and uoff == HEADER + ALIGN  # one block, each tensor aligned
    assert torch.equal(a.tensor(uoff, torch.bfloat16, (5,)), u)
    assert a.offset_of(a.tensor(off, torch.float32, (3, 4))) == off
    assert a.offset_of(t) is None  # not in the arena
    pid = os.fork()
    if pid == 0:  # the child doubles what it sees
        v = a.tensor(off, torch.float32, (3, 4))
        v.mul_(2)
        os._exit(0 if a.flag(FLAG_ABANDON) else 3)
    a.set_flag(FLAG_ABANDON)  # may land before or after the fork: check the copy, not the flag
    os.waitpid(pid, 0)
    assert torch.equal(a.tensor(off, torch.float32, (3, 4)), t * 2)


# ------------------------------------------------------------------ the process and its protocol


def _writer_process(root: Path, threads: int = 1) -> tuple[WriterProcess, ShardWriter]:
    writer = ShardWriter(root, manifest(), check_finite=False)
    publisher = BatchPublisher(writer, DiskGuard(str(root), 0), 4)
    return WriterProcess(publisher, Arena(1 << 20), threads, 4), writer


def _wire(wp: WriterProcess, sid: str, seed: int) -> WireItem:
    t = tensors(5, seed)
    _, (h, a) = copy_into(wp.arena, t["hidden_state"], t["aux_hidden_state"])
    return WireItem(
        sid,
        t["input_ids"].numpy(),
        t["loss_mask"].numpy(),
        (h, tuple(t["hidden_state"].shape), "float32"),
        (a, tuple(t["aux_hidden_state"].shape), "float32"),
        None,
    )


def test_batches_published_by_the_child_and_nothing_after_abandon(tmp_path: Path) -> None:
    wp, _ = _writer_process(tmp_path, threads=2)
    try:
        wp.submit(0, [_wire(wp, "a", 1), _wire(wp, "b", 2)])
        results = wp.outcomes()
        batch, outcome = next(results)
        assert batch == 0 and sorted(e.sample_id for e in outcome.written) == ["a", "b"]
        assert outcome.failed == [] and outcome.pause is None
        wp.arena.set_flag(FLAG_ABANDON)  # a second signal: publish nothing more
        wp.submit(1, [_wire(wp, "c", 3)])
        batch, outcome = next(results)
        assert batch == 1 and outcome.written == []
        wp.end()
        assert list(results) == []  # the goodbye
        assert wp.wait() == "exit status 0"
    finally:
        wp.close()
    assert sorted(load_index(str(tmp_path))) == ["a", "b"]
    for sid, want in (("a", tensors(5, 1)), ("b", tensors(5, 2))):
        got = torch.load(tmp_path / shard_relpath(sid), weights_only=True)
        assert torch.equal(got["aux_hidden_state"][0], want["aux_hidden_state"].to(torch.bfloat16))


def test_a_dead_child_is_reported_not_waited_for(tmp_path: Path) -> None:
    wp, _ = _writer_process(tmp_path)
    try:
        os.kill(wp.pid, signal.SIGKILL)
        with pytest.raises(WriterGone, match=r"ended without finishing \(killed by SIGKILL\)"):
            next(wp.outcomes())
        with pytest.raises(WriterGone, match=r"has gone \(killed by SIGKILL\)"):
            wp.submit(0, [_wire(wp, "s0", 0)])  # nobody reads the pipe any more
    finally:
        wp.close()


# ------------------------------------------------------------------ the runner with it

CTX = mp.get_context("fork")


@pytest.fixture(scope="module")
def env(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("wp")
    ds = write_tiny_dataset(root / "d.jsonl", N, seed=5)
    backend = SharedBackend(HFBackend(tiny_model_dir, [1, 3, 4], dtype="fp32"))
    ref = root / "ref"
    assert run(make_cfg(tiny_model_dir, ds, ref, batch_size=1), backend) == EXIT_OK
    return tiny_model_dir, ds, backend, load_shards(ref)


def _at_publish_call(monkeypatch, n: int, act) -> dict[str, int]:
    """BatchPublisher.publish doing `act()` at its n-th call, in the writer process (patched
    before the fork); the call count, which stays 0 here when the calls were the child's."""
    publish = BatchPublisher.publish
    calls = {"n": 0}

    def counted(self, items, threads, stopped):
        calls["n"] += 1
        if calls["n"] == n:
            act()
        return publish(self, items, threads, stopped)

    monkeypatch.setattr(BatchPublisher, "publish", counted)
    return calls


def test_the_writer_process_killed_mid_run_fails_the_run_cleanly_and_resume_completes(
    env, tmp_path, monkeypatch
) -> None:
    """SIGKILL to the writer process as it starts its third batch: the run ends as failed with
    the reason (no hang: the forward may be waiting for buffer space), the two batches indexed
    are whole, and the next run completes the rest, bit for bit."""
    model, ds, backend, reference = env
    publish = BatchPublisher.publish
    _at_publish_call(monkeypatch, 3, lambda: os.kill(os.getpid(), signal.SIGKILL))
    out = tmp_path / "out"
    logs: list[str] = []
    assert run(make_cfg(model, ds, out, batch_size=1), backend, logs) == EXIT_FAILED
    assert any("the writer process ended without finishing (killed by SIGKILL)" in m for m in logs), logs
    status = read_status(str(out))
    assert status["state"] == "failed" and "writer process" in status["message"]
    index = load_index(str(out))
    assert len(index) == 2
    report = verify_output(str(out), "deep")
    assert report.exit_code == 0 and report.ok == len(index)
    monkeypatch.setattr(BatchPublisher, "publish", publish)
    assert run(make_cfg(model, ds, out, batch_size=1), backend) == EXIT_OK
    assert_same_shards(out, reference)


def test_a_send_that_fails_in_the_forward_thread_stops_the_run_with_its_reason(
    env, tmp_path, monkeypatch
) -> None:
    """On a CPU the forward thread sends each batch itself: a send that fails there (the third)
    stops the run at once, as failed with the reason; the two batches sent before it are whole."""
    model, ds, backend, _ = env
    submit = WriterProcess.submit
    calls = {"n": 0}

    def failing(self, batch_id, items):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("cannot send")
        return submit(self, batch_id, items)

    monkeypatch.setattr(WriterProcess, "submit", failing)
    out = tmp_path / "out"
    logs: list[str] = []
    assert run(make_cfg(model, ds, out, batch_size=1), backend, logs) == EXIT_FAILED
    assert any("the writer failed: RuntimeError: cannot send" in m for m in logs), logs
    assert calls["n"] == 3  # nothing sent after it
    assert read_status(str(out))["state"] == "failed"
    assert len(load_index(str(out))) == 2
    report = verify_output(str(out), "deep")
    assert report.exit_code == 0 and report.ok == 2


def test_a_bug_in_the_writer_process_fails_the_run_with_its_reason(env, tmp_path, monkeypatch) -> None:
    model, ds, backend, _ = env

    def bug() -> None:
        raise RuntimeError("bug in the publisher")

    calls = _at_publish_call(monkeypatch, 2, bug)
    out = tmp_path / "out"
    logs: list[str] = []
    assert run(make_cfg(model, ds, out, batch_size=2), backend, logs) == EXIT_FAILED
    assert any("the writer process failed: RuntimeError: bug in the publisher" in m for m in logs), logs
    assert len(load_index(str(out))) == 2  # the first batch
    assert calls["n"] == 0  # the calls were the child's


def _runner_child(cfg_kw: dict, backend: SharedBackend, log_path: str) -> None:
    torch.set_num_threads(1)
    publish = BatchPublisher.publish

    def slow_publish(self, items, threads, stopped):  # the writer is mid-batch when the runner dies
        time.sleep(30)
        return publish(self, items, threads, stopped)

    BatchPublisher.publish = slow_publish  # before the runner forks its writer process
    with open(log_path, "a") as f:
        code = Runner(
            make_cfg(**cfg_kw), lambda _c, _i: backend, log=lambda m: (f.write(m + "\n"), f.flush())
        ).run()
    os._exit(code)


def test_the_writer_process_dies_with_the_runner(env, tmp_path) -> None:
    """kill -9 of the runner takes its writer process too (PR_SET_PDEATHSIG), at once, even in
    the middle of a batch (it would see the end of its pipe only after that): none is left to
    race the resumed run over the same output."""
    model, ds, backend, _ = env
    log = tmp_path / "log"
    p = CTX.Process(
        target=_runner_child,
        args=(dict(model=model, dataset=ds, output=tmp_path / "out", batch_size=1), backend, str(log)),
    )
    p.start()
    deadline = time.monotonic() + 60
    while "forward on" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # the first batch has reached the writer, which sleeps on it
    line = next(m for m in log.read_text().splitlines() if "writer process (pid" in m)
    writer_pid = int(line.split("(pid ")[1].split(",")[0])
    assert _alive(writer_pid)
    os.kill(p.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5  # not p.join(): its sentinel pipe is the writer's too
    while _alive(writer_pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    alive = _alive(writer_pid)
    if alive:
        os.kill(writer_pid, signal.SIGKILL)
    p.join(30)
    assert not alive


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_a_batch_larger_than_the_buffer_goes_in_parts_and_a_sample_larger_is_published_here(
    env, tmp_path, monkeypatch
) -> None:
    """A buffer smaller than a batch (no --max-length, long samples): the batch is sent in parts
    as space frees; a sample that cannot fit at all is published by the runner itself, beside
    the writer process: every shard, bit for bit as with writer threads, each indexed once."""
    model, ds, backend, _ = env
    token_bytes = 4 * 64 * 4  # hidden + 3 captured layers, fp32
    out, ref = tmp_path / "out", tmp_path / "ref"
    assert (
        run(make_cfg(model, ds, ref, batch_size=8, max_length=None, publisher="thread"), backend) == EXIT_OK
    )
    want = load_shards(ref)
    lengths = sorted(len(t["input_ids"]) for t in want.values())
    cap = lengths[N // 2] * token_bytes  # half the samples fit, a batch of 8 never does
    too_long = {sid for sid, t in want.items() if len(t["input_ids"]) * token_bytes > cap}
    assert 0 < len(too_long) < N and 8 * lengths[0] * token_bytes > cap
    monkeypatch.setattr(publish_process, "writer_buffer_bytes", lambda *a: cap)
    logs: list[str] = []
    cfg = make_cfg(model, ds, out, batch_size=8, max_length=None, publisher="process")
    assert run(cfg, backend, logs) == EXIT_OK
    assert sum("published by the runner itself" in m for m in logs) == 1, logs  # said once
    assert_same_shards(out, want)
    lines = (out / INDEX_NAME).read_text().splitlines()
    assert len(lines) == N  # each once
    report = verify_output(str(out), "deep")
    assert report.exit_code == 0 and report.ok == N


def test_no_writer_process_possible_means_writer_threads(env, tmp_path, monkeypatch) -> None:
    model, ds, backend, reference = env

    def no_memory(self, nbytes):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(Arena, "__init__", no_memory)
    logs: list[str] = []
    out = tmp_path / "out"
    assert run(make_cfg(model, ds, out, batch_size=1), backend, logs) == EXIT_OK
    assert any("cannot start the writer process ([Errno 12] Cannot allocate memory)" in m for m in logs), logs
    assert_same_shards(out, reference)


class _DeviceLike(SharedBackend):
    """The hf backend's CUDA path, on the CPU (the copy into `host_empty`'s buffers stands in
    for the device-to-host copy): the states land in the writer process's device ring when it
    has room, and stay in the backend's own memory (copied in by the courier) when it has not."""

    def __init__(self, inner: HFBackend):
        super().__init__(inner)
        self.landed = {"ring": 0, "own": 0}
        self.overflowed = threading.Event()

    def extract_async(self, samples, host_empty=None):
        from extraction.backends.base import SampleStates
        from extraction.backends.hf import PendingStates

        final, aux, lengths = self.inner.forward_states(samples)
        bufs = (
            host_empty([(tuple(final.shape), final.dtype), (tuple(aux.shape), aux.dtype)])
            if host_empty
            else None
        )
        self.landed["own" if bufs is None else "ring"] += 1
        if bufs is None:
            self.overflowed.set()
        if bufs is not None:
            bufs[0].copy_(final)
            bufs[1].copy_(aux)
            final, aux = bufs
        results = [
            SampleStates(s.sample_id, s.input_ids, final[row, :n], aux[row, :n])
            for row, (s, n) in enumerate(zip(samples, lengths, strict=True))
        ]
        pending = PendingStates(results, None)
        # The courier waits until the ring has overflowed once (batches pile up unsent): a fixed sleep
        # did not, on a loaded machine whose forward was slower than the sleep ({'ring': 8, 'own': 0}).
        # Bounded: a ring that never overflows ends the wait and fails the test's count, not the run.
        pending.wait = lambda: (self.overflowed.wait(10), results)[1]
        return pending


def _threads_reference(env, monkeypatch, root: Path, batch_size: int) -> dict[str, dict[str, torch.Tensor]]:
    """The shards writer threads write from the forward's own tensors at this batch size (the
    bit-for-bit reference; fp32 batches are not bit-identical across batch sizes)."""
    model, ds, backend, _ = env
    assert run(make_cfg(model, ds, root, batch_size=batch_size, publisher="thread"), backend) == EXIT_OK
    return load_shards(root)


def _with_extract_async(inner: HFBackend) -> SharedBackend:
    """The hf backend with its extract_async, as it runs in the CLI."""
    backend = SharedBackend(inner)
    backend.extract_async = inner.extract_async
    return backend


def test_the_device_ring_and_its_fallback_write_the_same_bits(env, tmp_path, monkeypatch) -> None:
    """The GPU path's buffer logic without a GPU: the buffer split into the device's ring and
    the courier's, a device ring too small for all the batches in flight (some go through the
    backend's own memory and the courier's ring): every shard the same, bit for bit."""
    model, ds, backend, _ = env
    reference, out = _threads_reference(env, monkeypatch, tmp_path / "ref", 2), tmp_path / "out"

    def pin(self, backend):  # what attach does on a GPU once cudaHostRegister succeeded
        self.arena.split(publish_process.DEVICE_BUFFER_SHARE)
        self.host_empty = self._host_empty  # and the courier sends, as on a GPU

    monkeypatch.setattr(ProcessPublisher, "attach", pin)
    batch = 2 * 40 * 4 * 64 * 4  # 2 samples of <= 40 tokens, hidden + 3 layers, fp32
    monkeypatch.setattr(publish_process, "writer_buffer_bytes", lambda *a: 3 * batch)
    device_like = _DeviceLike(backend.inner)
    assert run(make_cfg(model, ds, out, batch_size=2), device_like) == EXIT_OK
    assert device_like.landed["ring"] > 0 and device_like.landed["own"] > 0, device_like.landed
    assert_same_shards(out, reference)


def _count_copies(monkeypatch) -> list[int]:
    """The runner's copies into the writer's buffer: the number of tensors each copied."""
    calls: list[int] = []

    def counted(arena, *tensors):
        calls.append(len(tensors))
        return copy_into(arena, *tensors)

    monkeypatch.setattr(publish_process, "copy_into", counted)
    return calls


def _count_couriers(monkeypatch) -> list[int]:
    """Courier threads started."""
    started: list[int] = []
    courier = ProcessPublisher._courier

    def counted(self):
        started.append(1)
        return courier(self)

    monkeypatch.setattr(ProcessPublisher, "_courier", counted)
    return started


def test_a_cpu_forward_writes_its_states_into_the_buffer_and_sends_them_itself(
    env, tmp_path, monkeypatch
) -> None:
    """On a CPU the forward writes a batch's states straight into the writer's buffer and the
    forward thread sends the batch (no copy after, no courier thread to take the GIL from it):
    every shard the same, bit for bit, as writer threads write them from the forward's own tensors."""
    model, ds, backend, _ = env
    reference, out = _threads_reference(env, monkeypatch, tmp_path / "ref", 4), tmp_path / "out"
    copies, couriers = _count_copies(monkeypatch), _count_couriers(monkeypatch)
    assert run(make_cfg(model, ds, out, batch_size=4), _with_extract_async(backend.inner)) == EXIT_OK
    assert copies == [] and couriers == [], (copies, couriers)
    assert_same_shards(out, reference)


def test_a_failed_attempt_frees_what_its_forward_took_in_the_buffer(env, tmp_path, monkeypatch) -> None:
    """A CPU forward's states go into the writer's buffer as it runs: an attempt that fails after
    that (here every batch's first) frees its block, so the retry has the room (a buffer of one
    batch): no sample falls back to being published by the runner, every shard the same bits."""
    model, ds, backend, _ = env
    reference = _threads_reference(env, monkeypatch, tmp_path / "ref", 2)
    inner = backend.inner
    tried: set[tuple[str, ...]] = set()

    def first_attempt_fails(samples, host_empty=None):
        handle = inner.extract_async(samples, host_empty=host_empty)
        key = tuple(s.sample_id for s in samples)
        if key not in tried:
            tried.add(key)
            raise RuntimeError("after the forward")
        return handle

    flaky = SharedBackend(inner)
    flaky.extract_async = first_attempt_fails
    batch = 2 * 40 * 4 * 64 * 4  # 2 samples of <= 40 tokens, hidden + 3 layers, fp32
    monkeypatch.setattr(publish_process, "writer_buffer_bytes", lambda *a: batch)
    logs: list[str] = []
    out = tmp_path / "out"
    assert run(make_cfg(model, ds, out, batch_size=2), flaky, logs) == EXIT_OK
    assert len(tried) == N // 2
    assert not any("published by the runner itself" in m for m in logs), logs
    assert_same_shards(out, reference)


def test_a_cpu_batch_outside_the_buffer_goes_into_it_in_one_block_with_the_same_bits(
    env, tmp_path, monkeypatch
) -> None:
    """A batch whose states the forward could not write into the buffer (no room when it began)
    is copied there whole (one block, padding and all) and each sample's rows sent by offset,
    instead of a copy per sample: every shard the same, bit for bit."""
    model, ds, backend, _ = env
    reference, out = _threads_reference(env, monkeypatch, tmp_path / "ref", 4), tmp_path / "out"
    copies = _count_copies(monkeypatch)
    monkeypatch.setattr(ProcessPublisher, "_host_empty", lambda self, specs: None)  # never room
    assert run(make_cfg(model, ds, out, batch_size=4), _with_extract_async(backend.inner)) == EXIT_OK
    assert copies == [2] * (N // 4), copies  # one block a batch, not one a sample
    assert_same_shards(out, reference)
