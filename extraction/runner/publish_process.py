"""ProcessPublisher: shards published by a forked writer process (the runner's side of
extraction/publish/writerproc.py), so that no thread of the forward's process makes a system call per
shard or holds the GIL to publish.

Contract (the Publisher interface, extraction/publish/publisher.py, and):
- Constructing it forks the writer process with its shared buffer (writer_buffer_bytes): call it
  before the backend loads (the child must hold no CUDA state) and before any other helper is
  forked. OSError when that cannot be done (the caller falls back to threads).
- attach(backend): where the backend can write a batch's host states itself (hf's extract_async
  `host_empty`) they go straight into the buffer. On a CPU the forward writes them there and the
  forward thread sends each batch itself in put() (no courier thread: nothing is left to copy or
  wait for). On a GPU the buffer is page-locked for the run's device and split
  (DEVICE_BUFFER_SHARE for the device's copies, the rest for states copied in here), and a
  courier thread waits for each batch's copy before it sends it. States that are not in the buffer
  (another backend, no room when the forward began) are copied in: a batch whole in one block
  where it can be, else sample by sample, else in parts as space frees.
- A sample too long for the buffer at all is published by this process itself, beside the
  child (temp names carry the pid; index lines are appended whole, with O_APPEND); said once.
- Each outcome the child sends back goes to ledger.apply, on the outcome reader thread, and frees
  the batch's blocks. The child failing or dying, or a send failing, ends the run as failed with
  the reason and wakes a forward waiting for buffer space; close() kills and collects the child
  and unpins the buffer.
"""

from __future__ import annotations

import inspect
import itertools
import os
import queue
import threading
import time
from typing import Any

import torch

from extraction.backends.base import Sample, SampleStates
from extraction.backends.hf import dtype_name
from extraction.inputs.config import ExtractConfig
from extraction.publish.publisher import DRAIN_WRITER_THREADS, BatchPublisher, Item, Work, wait_ready
from extraction.publish.writerproc import (
    FLAG_ABANDON,
    FLAG_DRAIN,
    Arena,
    ArenaFull,
    Place,
    WireItem,
    WriterGone,
    WriterProcess,
    copy_into,
)
from extraction.runner.lifecycle import Lifecycle
from extraction.runner.plan import QUEUE_BATCHES
from extraction.runner.resume import ITEMSIZE
from extraction.runner.timing import record_usage, thread_usage
from extraction.shards.filebytes import in_memory
from hsx import cores
from hsx.manifest import RunManifest

# The states of this many batches (at their longest) may wait for the writer process, in the
# shared buffer: the forward pass waits for space beyond that, as it waits on a writer thread's queue.
WRITER_BUFFER_BATCHES = QUEUE_BATCHES + 2
WRITER_BUFFER_MAX = 8 << 30
# On a GPU, the share of that buffer the device's copies land in; the rest takes what is copied in
# here (a batch too large for the device's share, the one-by-one retry path).
DEVICE_BUFFER_SHARE = 0.75


def writer_buffer_bytes(batch_size: int, max_tokens: int, token_bytes: int) -> int:
    """The writer process's shared buffer: WRITER_BUFFER_BATCHES batches at their longest, at
    least two samples at their longest, never more than WRITER_BUFFER_MAX or an eighth of the
    memory (it is pinned on a GPU host). A sample too long for it is published by the runner."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        memory = 8 * WRITER_BUFFER_MAX
    cap = min(WRITER_BUFFER_MAX, memory // 8)
    sample = max_tokens * token_bytes
    return min(cap, max(2 * sample, WRITER_BUFFER_BATCHES * batch_size * sample))


class ProcessPublisher:
    """The writer process's publisher (see the module's contract)."""

    kind = "process"

    def __init__(
        self,
        cfg: ExtractConfig,
        manifest: RunManifest,
        max_positions: int,
        batch_publisher: BatchPublisher,
        ledger: Lifecycle,
        writer_threads: int,
    ):
        self.cfg, self.ledger, self.batch_publisher = cfg, ledger, batch_publisher
        self.timings, self.log = ledger.timings, ledger.log
        self.host_empty = None  # attach() sets it where the backend can use the buffer
        self.put_key = "forward_wait_writer_s"  # the courier's queue; "forward_send_s" if put() sends
        token_bytes = (1 + manifest.num_aux) * manifest.hidden_size * ITEMSIZE[manifest.dtype]
        size = writer_buffer_bytes(
            cfg.batch_size, min(cfg.max_length or max_positions, max_positions), token_bytes
        )
        drain = min(DRAIN_WRITER_THREADS, cores.usable_cores())
        self.wp = WriterProcess(batch_publisher, Arena(size), writer_threads, drain)
        self.arena = self.wp.arena
        self.log(f"shards published by a writer process (pid {self.wp.pid}, {size / 2**20:.1f} MiB buffer)")
        self._sends_here = False  # the forward thread sends its batches itself (put)
        self._allocs: list[int] = []  # buffer blocks the batch in the forward has taken
        self._in_writer: dict[int, tuple[Work, list[int]]] = {}  # batch id -> (batch, blocks it frees)
        self._in_writer_lock = threading.Lock()
        self._batch_ids = itertools.count()  # each part of a batch sent to the writer process
        self._published_here = 0  # samples too long for the buffer, published by this process
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_BATCHES)  # forward -> courier
        self._threads: list[threading.Thread] = []
        self._closed = False

    # ------------------------------------------------------------------ the Publisher calls

    def attach(self, backend: Any) -> None:
        """Let the forward's states go straight into the buffer where the backend can put them
        there (hf's `host_empty`): on a CPU the forward writes them and sends each batch itself;
        on a GPU the buffer is page-locked, the device's copies land in it, and the courier waits
        for each batch's copy before it sends it."""
        extract_async = getattr(backend, "extract_async", None)
        shares = extract_async is not None and "host_empty" in inspect.signature(extract_async).parameters
        if not self.cfg.device.startswith("cuda"):
            self.host_empty = self._host_empty if shares else None
            self._sends_here = shares or extract_async is None  # host tensors once the call returns
            if self._sends_here:
                self.put_key = "forward_send_s"
            return
        if not shares:
            return
        t0 = time.perf_counter()
        err = self.arena.register_cuda(torch.device(self.cfg.device))
        self.timings["pin_s"] = time.perf_counter() - t0
        if err is not None:
            self.log(
                f"cannot pin the writer's buffer ({err}): states copied into it from torch's pinned memory"
            )
            return
        self.arena.split(DEVICE_BUFFER_SHARE)
        self.host_empty = self._host_empty

    def start(self) -> None:
        targets = [(self._collect_outcomes, "hsx-outcomes")]
        if not self._sends_here:
            targets.insert(0, (self._courier, "hsx-courier"))
        self._threads = [threading.Thread(target=t, name=n, daemon=True) for t, n in targets]
        for thread in self._threads:
            thread.start()

    def put(self, work: Work) -> None:
        work.allocs, self._allocs = self._allocs, []
        if self._sends_here:
            self._send_here(work)
        else:
            self._queue.put(work)

    def release_attempt(self) -> None:
        """Free the blocks a failed attempt took (a CPU forward's states, a GPU's copies: once
        those have landed), so that its retries and the one-by-one path have the room; on a broken
        device context they stay taken (the run is ending)."""
        allocs, self._allocs = self._allocs, []
        if allocs and self.cfg.device.startswith("cuda"):
            try:
                torch.cuda.synchronize()  # its copies into them may still be landing
            except Exception:
                return
        self._free(allocs)

    def drain(self) -> None:
        self.arena.set_flag(FLAG_DRAIN)

    def finish(self) -> None:
        if self._sends_here:
            self.wp.end()  # the courier's last word otherwise
        self._queue.put(None)
        for thread in self._threads:
            while thread.is_alive():
                thread.join(timeout=0.5)

    def abandon(self) -> None:
        self.arena.set_flag(FLAG_ABANDON)

    def close(self) -> None:
        """Collect the writer process (killed if it still runs: an error path) and unpin its
        buffer; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.wp.close()
        self.arena.close("the run has ended")
        try:
            self.arena.release()
        except Exception as e:  # a broken CUDA context: the process ends soon anyway
            self.log(f"cannot unpin the writer's buffer: {e}")

    # ------------------------------------------------------------------ the buffer

    def _host_empty(self, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor] | None:
        """Host memory for a batch's states in the buffer (pinned on a GPU); None (the backend
        then uses memory of its own, and _send copies) when the buffer cannot take the batch
        without waiting on batches not sent yet."""
        try:
            tensors, block = self.arena.empty(specs)
        except (ArenaFull, ValueError, WriterGone):  # WriterGone: the run is ending anyway
            return None
        self._allocs.append(block)
        return tensors

    def _free(self, allocs: list[int]) -> None:
        for offset in allocs:
            self.arena.free(offset)

    def _free_after_copies(self, work: Work) -> None:
        """Free a batch's blocks that were never sent, once its copies into them are done."""
        if work.allocs and work.ready is not None:
            try:
                work.ready()
            except Exception:  # a device error: nothing is copying any more
                pass
        self._free(work.allocs)

    # ------------------------------------------------------------------ sending

    def _courier(self) -> None:
        """Hands the forward's batches to the writer process on a GPU: waits for each batch's copy
        to the host, then sends it (_send)."""
        usage = thread_usage()
        try:
            while True:
                work = self._queue.get()
                if work is None:
                    return
                self._deliver(work)
        except BaseException as e:  # never leave the forward thread blocked on a full queue
            self._sending_failed(e)
            while (work := self._queue.get()) is not None:
                self._free_after_copies(work)
        finally:
            self.wp.end()
            record_usage(self.timings, "courier", usage)

    def _deliver(self, work: Work) -> None:
        """A batch from the forward to the writer process (the courier's, or on a CPU the forward
        thread's own): dropped when the run has stopped writing, failed when its copy to the host
        did, else sent once its states are on the host."""
        if self.ledger.stopped_writing():
            self._free_after_copies(work)  # not written: these samples stay pending
            return
        if not wait_ready(work, self.ledger):
            self._free(work.allocs)
            return
        self._send(work)

    def _send_here(self, work: Work) -> None:
        """The forward thread's own delivery (on a CPU), failing as the courier fails."""
        try:
            self._deliver(work)
        except BaseException as e:  # its blocks stay taken, as the courier leaves them: the run ends
            self._sending_failed(e)

    def _sending_failed(self, e: BaseException) -> None:
        """Sending to the writer process failed: the run stops, and a forward waiting for space
        in the buffer wakes (no batch will free any now)."""
        reason = str(e) if isinstance(e, WriterGone) else self.ledger.writer_failed(e)
        self.ledger.stop_event.set()
        self.arena.close(reason)

    def _send(self, work: Work) -> None:
        """Send a batch to the writer process: its states that are not in the buffer yet put there
        first (the whole batch in one block where it can be, else sample by sample; a sample too
        long for the buffer published here)."""
        places = self._batch_into_buffer(work)
        wire: list[WireItem] = []
        blocks: list[int] = []
        for i, (s, st) in enumerate(zip(work.samples, work.results, strict=True)):
            if s.sample_id not in work.pending:
                continue
            place = places[i] if places is not None else None
            try:
                if place is not None:  # copied with its batch
                    hidden, aux = place
                else:
                    try:
                        hidden, aux = self._shared(st, blocks)
                    except ArenaFull:  # what it holds is this batch's: send that part first
                        if not wire:
                            raise
                        self._submit(work, wire, blocks)
                        wire, blocks = [], []
                        hidden, aux = self._shared(st, blocks)
            except (ValueError, ArenaFull) as e:  # longer than the buffer (no --max-length)
                self._publish_here(work, s, st, e)
                continue
            wire.append(
                WireItem(s.sample_id, s.input_ids.numpy(), s.loss_mask.numpy(), hidden, aux, st.finite)
            )
        self._submit(work, wire, blocks + work.allocs)  # its last part frees the whole batch's

    def _batch_into_buffer(self, work: Work) -> list[tuple[Place, Place] | None] | None:
        """Copy a batch's two state tensors whole into one block of the buffer (padding and all):
        each result's (hidden, aux) place there as _shared gives it, None for a result whose states
        are not the first rows of its row; None for the whole batch when the states are in the
        buffer already (the usual case: a CPU forward writes them there, a GPU's copies land
        there) or the batch does not fit it (_shared then copies sample by sample).

        For the states in the backend's own memory (the buffer had no room for them when the
        forward began; a GPU's copies into torch's pinned memory). Why whole: each NumPy copy and
        torch call releases the GIL, and a CPU forward (whose ops release it too) then waits to
        take it back: two copies a batch, the rest integer arithmetic, instead of two a sample."""
        if work.batch is None or not any(s.sample_id in work.pending for s in work.samples):
            return None
        arena = self.arena
        final, aux = work.batch
        if arena.offset_of(final) is not None or not (final.is_contiguous() and aux.is_contiguous()):
            return None
        try:
            block, (at_final, at_aux) = copy_into(arena, final, aux)
        except (ArenaFull, ValueError):
            return None
        work.allocs.append(block)  # freed with the batch's last part, as the device's blocks are
        (_, width, hidden), layers = final.shape, aux.shape[2]
        row_final, row_aux = width * hidden * final.element_size(), width * layers * aux.element_size()
        ptr_final, ptr_aux = final.data_ptr(), aux.data_ptr()
        name_final, name_aux = dtype_name(final.dtype), dtype_name(aux.dtype)
        places: list[tuple[Place, Place] | None] = []
        for row, st in enumerate(work.results):
            h, a = st.hidden_state, st.aux_hidden_state
            n = h.shape[0]
            if (
                h.data_ptr() != ptr_final + row * row_final
                or a.data_ptr() != ptr_aux + row * row_aux
                or tuple(h.shape) != (n, hidden)
                or tuple(a.shape) != (n, layers)
                or h.dtype != final.dtype
                or a.dtype != aux.dtype
            ):
                places.append(None)
                continue
            places.append(
                (
                    (at_final + row * row_final, (n, hidden), name_final),
                    (at_aux + row * row_aux, (n, layers), name_aux),
                )
            )
        return places

    def _shared(self, st: SampleStates, blocks: list[int]) -> list[Place]:
        """(offset, shape, dtype name) of a sample's two state tensors in the buffer, copied there
        first (one block, added to `blocks`) if they are not in it (the CPU's states, or a GPU's
        in torch's pinned memory)."""
        arena = self.arena
        tensors = (in_memory(st.hidden_state), in_memory(st.aux_hidden_state))  # FileBytes read here
        offsets = [arena.offset_of(t) for t in tensors]
        if None in offsets:
            block, offsets = copy_into(arena, *tensors)
            blocks.append(block)
        return [(o, tuple(t.shape), dtype_name(t.dtype)) for o, t in zip(offsets, tensors, strict=True)]

    def _publish_here(self, work: Work, sample: Sample, st: SampleStates, why: Exception) -> None:
        """A sample too long for the buffer, published by this process beside the writer process
        (temp names carry the pid; index lines are appended whole, with O_APPEND)."""
        if not self._published_here:
            self.log(f"sample {sample.sample_id!r}: {why}: published by the runner itself (set --max-length)")
        self._published_here += 1
        item = Item(
            sample.sample_id,
            sample.input_ids,
            sample.loss_mask,
            st.hidden_state,
            st.aux_hidden_state,
            st.finite,
        )
        self.ledger.apply(work, self.batch_publisher.publish([item], 1, self.ledger.stopped_writing))

    def _submit(self, work: Work, wire: list[WireItem], blocks: list[int]) -> None:
        """Send (part of) a batch; its outcome will free `blocks`."""
        batch_id = next(self._batch_ids)
        with self._in_writer_lock:
            self._in_writer[batch_id] = (work, blocks)
        self.wp.submit(batch_id, wire)
        self.arena.mark_sent(blocks)  # after: a send that failed leaves none to wait for

    # ------------------------------------------------------------------ outcomes

    def _collect_outcomes(self) -> None:
        """Applies the writer process's outcomes as they come; a writer that failed or died ends
        the run as failed, and wakes a forward pass waiting for buffer space."""
        wp = self.wp
        usage = thread_usage()
        try:
            for batch_id, outcome in wp.outcomes():
                with self._in_writer_lock:
                    work, blocks = self._in_writer.pop(batch_id)
                self._free(blocks)
                self.ledger.apply(work, outcome)
        except BaseException as e:
            if isinstance(e, WriterGone):
                reason = str(e)
                self.ledger.fail(reason)
            else:
                reason = self.ledger.writer_failed(e)
            self.ledger.stop_event.set()
            wp.arena.close(reason)
            wp.kill()
        finally:
            record_usage(self.timings, "outcomes", usage)
