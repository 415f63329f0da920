"""Publishing one batch's shards: disk guard, NaN/Inf check, atomic write, one index commit.

Shared by the runner's writer thread and its writer process (extraction/writerproc.py). It says
what happened (an Outcome) and changes nothing else: the run's bookkeeping (counters, errors.jsonl,
the pause, the abort) stays with the runner, in the process that owns the run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy
import torch

from extraction.diskguard import DiskGuard, DiskLow, estimate_shard_bytes
from extraction.shards import DiskFullError, IndexEntry, ShardDataError, ShardWriter
from extraction.shards import format as fmt

_EXPONENT = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
}


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/Inf: no element with an all-ones exponent, found by a masked max over the bits.

    In NumPy, not torch: this runs on the writer threads, and a torch op there starts an OpenMP
    team of its own (torch.get_num_threads() threads) beside the forward pass's, which then waits
    at its barriers for cores: on a 16-core host the CPU runner ran at 0.33x of a forward-only
    loop. NumPy's elementwise ops use one thread, and are 2-10x faster here than torch's on one."""
    spec = _EXPONENT.get(t.dtype)
    if spec is None or t.numel() == 0 or t.stride(-1) != 1 or t.device.type != "cpu":
        return bool(torch.isfinite(t).all())
    itype, mask = spec
    bits = t.view(itype).numpy()
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
        for key, t in ((fmt.KEY_HIDDEN, self.hidden_state), (fmt.KEY_AUX, self.aux_hidden_state)):
            if not all_finite(t):
                return key
        return None if self.finite is None else f"{fmt.KEY_HIDDEN} or {fmt.KEY_AUX}"


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
