"""The Publisher interface, and the shard publishing every publisher shares.

A Publisher takes the forward pass's batches (`Work`) to indexed shards beside the forward pass.
Two implementations, chosen by ONE option, `ExtractConfig.publisher` (`--publisher`; see
extraction/runner/publish.py's make_publisher): ThreadPublisher (writer threads in the runner's
process; the sglang backend's default) and ProcessPublisher (a forked writer process fed through
a shared buffer, extraction/runner/publish_process.py; the hf backend's default).

Both publish a batch with a BatchPublisher (here: disk guard, NaN/Inf check, atomic shard, one
index commit a batch), the writer process in its child. A BatchPublisher says what happened (an
Outcome) and changes nothing else: the run's bookkeeping (counters, errors.jsonl, the pause, the
abort) stays with the runner's Ledger, in the process that owns the run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy
import torch

from extraction.backends.base import Sample, SampleStates
from extraction.publish.diskguard import DiskGuard, DiskLow, estimate_shard_bytes
from extraction.shards import DiskFullError, ShardDataError, ShardWriter
from extraction.shards.filebytes import EXPONENT_MASKS
from hsx import cores
from hsx.index import IndexEntry
from hsx.layout import KEY_AUX, KEY_HIDDEN

# Once the forward pass is over nothing competes with the publishing for the GIL: the batches
# still queued (the last one or two, which the run waits for) are published by up to this many
# threads at once (never more than the usable cores, never fewer than the run's writer threads).
DRAIN_WRITER_THREADS = 8

# extract_async's `host_empty`: host tensors of these (shape, dtype)s for a batch's states, or None
HostEmpty = Callable[[list[tuple[tuple[int, ...], torch.dtype]]], "list[torch.Tensor] | None"]


def drain_threads(writer_threads: int) -> int:
    """Threads publishing a batch once the forward pass is over."""
    return max(writer_threads, min(DRAIN_WRITER_THREADS, cores.usable_cores()))


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/Inf: no element with an all-ones exponent, found by a masked max over the bits.

    In NumPy, not torch: this runs on the publishing threads, and a torch op there would start an
    OpenMP team of its own (torch.get_num_threads() threads) beside the forward pass's, which then
    waits at its barriers for cores. NumPy's elementwise ops use one thread. No torch op runs
    here but views (a test checks)."""
    spec = EXPONENT_MASKS.get(t.dtype)
    if spec is None or t.numel() == 0 or t.stride(-1) != 1 or t.device.type != "cpu":
        return bool(torch.isfinite(t).all())
    itype, mask = spec
    bits = t.view(torch.uint8).numpy().view(itype)  # bytes to numpy: it has no bfloat16
    return int(numpy.bitwise_and(bits, mask).max()) != mask


def write_failed(e: BaseException) -> str:
    """errors.jsonl's reason for a shard not written: the message of a disk or data error, the
    type too for anything else (a bug, an odd tensor)."""
    if isinstance(e, OSError | ShardDataError):
        return f"write failed: {e}"
    return f"write failed: {type(e).__name__}: {e}"


@dataclass
class Item:
    """One sample to publish: its tokens and its states on the host."""

    sample_id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden_state: torch.Tensor
    aux_hidden_state: torch.Tensor
    finite: bool | None = None  # the backend's own NaN/Inf check, if it made one

    def nonfinite(self) -> str | None:
        """The name of a tensor holding NaN/Inf, or None; trusts the backend's check if it made one."""
        if self.finite is True:
            return None
        for key, t in ((KEY_HIDDEN, self.hidden_state), (KEY_AUX, self.aux_hidden_state)):
            if not all_finite(t):
                return key
        return None if self.finite is None else f"{KEY_HIDDEN} or {KEY_AUX}"


@dataclass
class Outcome:
    """What publishing a batch did: shards indexed, samples failed, a pause, the guard's figures."""

    written: list[IndexEntry] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (sample id, reason)
    pause: DiskLow | DiskFullError | None = None
    free: int | None = None  # free bytes as the guard last saw them, less the shards being written
    last_free: int | None = None  # the guard's own last figure (the pause message quotes it)
    largest: int = 0  # the guard's largest shard so far (its reserve grows with it)
    publish_s: float = 0.0


@dataclass
class Work:
    """One planned batch on its way from the tokenizer through the forward to a Publisher: every
    sample ran; only the `pending` ones (not done before) are published."""

    samples: list[Sample]
    pending: set[str]
    results: list[SampleStates] = field(default_factory=list)
    ready: Callable[[], Any] | None = None  # blocks until the results' tensors are on the host
    batch: tuple[torch.Tensor, torch.Tensor] | None = None  # the results' states are views of these
    allocs: list[int] = field(default_factory=list)  # its blocks of the writer process's buffer

    def items(self) -> list[Item]:
        """The pending samples' Items."""
        return [
            Item(s.sample_id, s.input_ids, s.loss_mask, st.hidden_state, st.aux_hidden_state, st.finite)
            for s, st in zip(self.samples, self.results, strict=True)
            if s.sample_id in self.pending
        ]


class Ledger(Protocol):
    """The run's bookkeeping a Publisher reports into (the runner's Lifecycle). Its methods may be
    called from the publisher's threads."""

    stop_event: threading.Event  # set: the run stops (the forward takes no new batch)
    forward_done: threading.Event  # set: no batch will be put any more (the drain)
    timings: dict[str, float]

    def log(self, msg: str) -> None: ...

    def apply(self, work: Work, outcome: Outcome) -> None:
        """A published batch's outcome into the run: failed samples, the pause, the counters."""

    def sample_failed(self, sample: Sample, reason: str, attempts: int | None = None) -> None: ...

    def writer_failed(self, e: BaseException) -> str:
        """The publishing side raised: a full disk pauses the run, anything else fails it; the
        reason, logged. The caller stops the run."""
        ...

    def fail(self, reason: str) -> None:
        """End the run as failed (the first reason wins), logged; stops the run."""

    def stopped_writing(self) -> bool:
        """True once nothing more may be published (a second signal, or a pause)."""
        ...


class Publisher(Protocol):
    """Takes the forward's batches to indexed shards, beside the forward pass.

    The calls, in the runner's order: constructed before the backend loads and before any other
    helper process is forked; `attach(backend)` once the backend is up; `start()`; then, from the
    forward thread only, `put(work)` for each batch the forward produced and `release_attempt()`
    after a forward attempt that produced none; `drain()` once the forward pass is over;
    `finish()`, which returns once every batch put is published or dropped; `close()` last and
    always (after an error too, or when start() never ran). `abandon()` may come at any time
    (a second signal).

    What every implementation promises:
    - each pending sample of a batch put is published once (an atomic shard, indexed with its
      batch or part of a batch), or reported failed (through ledger.apply or
      ledger.sample_failed), or left pending (the run stopped writing, abandon(), a pause): a
      rerun redoes it; nothing is half-written or indexed twice;
    - every outcome reaches ledger.apply in the runner's process;
    - a failure of the publishing side itself goes to ledger.writer_failed or ledger.fail and
      stops the run; it never leaves the forward thread blocked in put();
    - put() blocks only for back-pressure (a full queue, no room in the buffer).
    """

    kind: str  # "thread" or "process": who writes the shards
    put_key: str  # the timings key the forward thread adds its time in put() to
    # Set by attach(): where the backend may write a batch's host states itself
    # (extract_async(host_empty=...)); None: in memory of the backend's own.
    host_empty: HostEmpty | None

    def attach(self, backend: Any) -> None: ...

    def start(self) -> None: ...

    def put(self, work: Work) -> None: ...

    def release_attempt(self) -> None:
        """Free what a failed forward attempt took of the publisher's memory (host_empty's)."""

    def drain(self) -> None:
        """The forward pass is over: publish what is left with more threads."""

    def finish(self) -> None: ...

    def abandon(self) -> None:
        """A second signal: publish nothing more (what is left stays pending)."""

    def close(self) -> None: ...


def wait_ready(work: Work, ledger: Ledger) -> bool:
    """Block until the batch's states are on the host; False (its pending samples failed) when the
    device reports an error there. Times the wait as writer_wait_copy_s."""
    if work.ready is None:
        return True
    t0 = time.perf_counter()
    try:
        work.ready()
    except Exception as e:  # an asynchronous device error surfaces here
        for sample in work.samples:
            if sample.sample_id in work.pending:
                ledger.sample_failed(sample, f"copy to host failed: {type(e).__name__}: {e}")
        return False
    finally:
        ledger.timings["writer_wait_copy_s"] += time.perf_counter() - t0
    return True


class BatchPublisher:
    """Publishes batches with up to `threads` shards written at once; one index commit a batch.

    Once the disk guard or a full disk has paused it, it publishes nothing more (`paused`)."""

    def __init__(self, writer: ShardWriter, guard: DiskGuard, itemsize: int):
        self.writer = writer
        self.guard = guard
        self.itemsize = itemsize
        self.paused: DiskLow | DiskFullError | None = None
        self._lock = threading.Lock()
        self._inflight_bytes = 0
        self._pools: dict[int, ThreadPoolExecutor] = {}

    def publish(self, items: list[Item], threads: int, stopped: Callable[[], bool]) -> Outcome:
        """Write the items' shards (`threads` at once; checking `stopped` before each), then index
        the written ones with one commit."""
        t0 = time.perf_counter()
        out = Outcome()
        if threads <= 1 or len(items) <= 1:
            written = []
            for item in items:
                if stopped() or self.paused is not None:
                    break
                written.append(self._write(item, out))
        else:  # a batch's shards in parallel; the batch is done before the next one starts
            pool = self._pools.get(threads)
            if pool is None:
                pool = self._pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="hsx-writer")
            futures = [pool.submit(self._write_unless_stopped, item, out, stopped) for item in items]
            written = [f.result() for f in futures]
        self._commit([e for e in written if e is not None], out)
        out.pause = self.paused if out.pause is None else out.pause
        out.largest, out.last_free = self.guard.largest, self.guard.last_free
        out.publish_s = time.perf_counter() - t0
        return out

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self._pools.clear()

    def _write_unless_stopped(
        self, item: Item, out: Outcome, stopped: Callable[[], bool]
    ) -> IndexEntry | None:
        if stopped() or self.paused is not None:
            return None
        return self._write(item, out)

    def _pause(self, reason: DiskLow | DiskFullError, out: Outcome) -> None:
        with self._lock:
            if self.paused is None:
                self.paused = reason
            out.pause = out.pause or reason
            if isinstance(reason, DiskLow):
                out.free = reason.free  # the figure the pause message quotes

    def _write(self, item: Item, out: Outcome) -> IndexEntry | None:
        """Disk guard, NaN check and the shard's file (ShardWriter.write); None when it was not
        written (paused, or the sample failed: both recorded in `out`)."""
        n = int(item.input_ids.numel())
        m = self.writer.manifest
        needed = estimate_shard_bytes(n, m.hidden_size, m.num_aux, self.itemsize)
        with self._lock:  # parallel writers: count the shards still being written as used
            try:
                free = self.guard.check(needed)
                if free - self._inflight_bytes - needed < self.guard.reserve:
                    raise DiskLow(free - self._inflight_bytes, self.guard.reserve, needed, self.guard.path)
            except DiskLow as e:
                low = e
            else:
                low = None
                out.free = free - self._inflight_bytes
                self._inflight_bytes += needed
        if low is not None:
            self._pause(low, out)
            return None
        try:
            bad = item.nonfinite()
            if bad is not None:
                raise ShardDataError(f"sample {item.sample_id!r}: {bad} has NaN or Inf values")
            return self.writer.write(
                item.sample_id, item.input_ids, item.loss_mask, item.hidden_state, item.aux_hidden_state
            )
        except DiskFullError as e:
            self._pause(e, out)
            return None
        except Exception as e:  # the file was taken back: this sample failed, the run goes on
            with self._lock:
                out.failed.append((item.sample_id, write_failed(e)))
            return None
        finally:
            with self._lock:
                self._inflight_bytes -= needed

    def _commit(self, written: list[IndexEntry], out: Outcome) -> None:
        """Index the batch's written shards at once (ShardWriter.commit): one index write and
        fsync a batch. On failure they were all taken back (not done: resume redoes them)."""
        if not written:
            return
        try:
            self.writer.commit(written)
        except DiskFullError as e:
            self._pause(e, out)
            return
        except Exception as e:
            out.failed.extend((entry.sample_id, write_failed(e)) for entry in written)
            return
        out.written.extend(written)
