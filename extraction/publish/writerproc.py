"""The shard writer in a process of its own, fed through a shared anonymous mapping.

Why: a writer thread shares the GIL with the forward pass. Every system call it makes (write,
fsync, rename, statvfs) releases the GIL, and taking it back means waiting for the forward
thread, whose Python dispatch is what bounds a forward pass (every op on the CPU; the MoE layers
on the GPU): each hand-over takes time from it. A child process has a GIL of its own.

How: the child is forked before the model loads (so it never holds CUDA state). The states
travel through an `Arena`, an anonymous shared mapping made before the fork (MAP_SHARED |
MAP_ANONYMOUS: both processes see the same pages; no /dev/shm to fill or clean up). On a GPU the
arena is registered as pinned memory, and each batch's copy to the host lands in it directly;
on the CPU the forward writes its states there. A small message per batch (ids, tokens, where
each tensor lies: `WireItem`) goes down a pipe; the child publishes the batch with the same
BatchPublisher a writer thread uses and sends back its Outcome; then the batch's space is reused.
The run's bookkeeping (counters, errors.jsonl, the pause, status.json) stays in this process: its
side of the protocol is extraction/runner/publish_process.py (ProcessPublisher).

The child ignores SIGINT and SIGTERM (the runner decides when it stops, as for the tokenizer),
and is killed with this process (PR_SET_PDEATHSIG): a kill -9 of the runner does not leave a
writer publishing on for a resumed run to race (a system call in flight, an fsync, still ends
first); what it had published is complete and indexed, what it had not is not.
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import mmap
import os
import pickle
import signal
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy
import torch

from extraction.process.childgen import FRAME, reap, send_message
from extraction.publish.publisher import BatchPublisher, Item, Outcome

HEADER = 4096  # the arena's first page: flags the child reads before each shard
ALIGN = 256
FLAG_ABANDON = 0  # a second signal: publish nothing more
FLAG_DRAIN = 1  # the forward pass has ended: more writer threads
_PIPE_BYTES = 1 << 20  # a batch's tokens in one pipe write (Linux's unprivileged maximum)
_PR_SET_PDEATHSIG = 1
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable
_in_writer = False

Place = tuple[int, tuple[int, ...], str]  # a tensor in the arena: (offset, shape, dtype name)


class WireItem(NamedTuple):
    """One sample as it goes down the pipe to the child: its tokens (NumPy arrays pickle as their
    bytes), its two states by their place in the arena, the backend's NaN/Inf check."""

    sample_id: str
    input_ids: numpy.ndarray
    loss_mask: numpy.ndarray
    hidden: Place
    aux: Place
    finite: bool | None

    def item(self, arena: Arena) -> Item:
        """The child's Item: tensors sharing the arrays' and the arena's memory."""
        return Item(
            self.sample_id,
            torch.from_numpy(self.input_ids),
            torch.from_numpy(self.loss_mask),
            arena.at(self.hidden),
            arena.at(self.aux),
            self.finite,
        )


def in_writer_process() -> bool:
    """True in the writer process (the crash tests time their kills by its system calls)."""
    return _in_writer


class WriterGone(RuntimeError):
    """The writer process has failed or ended: no space will be freed any more."""


class ArenaFull(RuntimeError):
    """No room, and none of the space in use is the writer's to free: waiting would never end."""


class _Ring:
    """A ring allocator over [start, end) of the mapping: blocks allocated in order, freed in any
    order; space comes back as the oldest (or newest) blocks are freed."""

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end
        self.capacity = end - start
        # [offset, size, freed, sent], in allocation order. Sent: in a batch the writer has, so
        # its outcome will free it; only those are worth waiting for.
        self.blocks: deque[list[int]] = deque()
        self.index: dict[int, list[int]] = {}

    def place(self, n: int) -> int | None:
        if not self.blocks:
            return self.start
        first = self.blocks[0][0]
        end = self.blocks[-1][0] + self.blocks[-1][1]
        if end > first:  # not wrapped: after the newest block, else from the start
            if end + n <= self.end:
                return end
            return self.start if self.start + n <= first else None
        return end if end + n <= first else None

    def free(self, offset: int) -> bool:
        block = self.index.pop(offset, None)
        if block is None:
            return False
        block[2] = 1
        while self.blocks and self.blocks[0][2]:
            self.blocks.popleft()
        while self.blocks and self.blocks[-1][2]:
            self.blocks.pop()
        return True

    def waiting_helps(self) -> bool:
        return any(b[3] and not b[2] for b in self.blocks)


DEVICE, COPY = "device", "copy"  # the two rings, once split: the GPU's copies, the courier's


class Arena:
    """A shared anonymous mapping with ring allocators: batches are allocated in order and
    freed (about) in order, as the child finishes them.

    One ring at first. On a GPU it is split: the device's copies (allocated by the forward
    thread, sent later by the courier) and the courier's own copies (states that could not go
    to the device's ring) each get a ring, so neither waits for space the other holds unsent."""

    def __init__(self, nbytes: int):
        self.capacity = -(-max(nbytes, ALIGN) // ALIGN) * ALIGN
        self.size = HEADER + self.capacity
        self.mm = mmap.mmap(-1, self.size)  # MAP_SHARED | MAP_ANONYMOUS on Linux
        self.whole = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.address = self.whole.data_ptr()
        ring = _Ring(HEADER, self.size)
        self._rings = {DEVICE: ring, COPY: ring}
        self._cond = threading.Condition()
        self._closed: str | None = None
        self.registered = False
        self.device: torch.device | None = None

    def split(self, device_share: float) -> None:
        """Give the device's copies their own ring (this share of the space), the rest to the
        courier's. Only before anything is allocated."""
        with self._cond:
            assert not self._rings[COPY].blocks, "split an arena in use"
            mid = HEADER + int(self.capacity * device_share) // ALIGN * ALIGN
            self._rings = {DEVICE: _Ring(HEADER, mid), COPY: _Ring(mid, self.size)}

    # -- allocation (this process) ---------------------------------------------------------
    def alloc(self, nbytes: int, ring: str = COPY) -> int:
        """The offset of `nbytes` free bytes, waiting for the child to free some if need be.

        Waits only while some block in use has been sent to the child (mark_sent): space held
        by batches not sent yet is freed only after the caller (or the thread it waits on) goes
        on, so waiting for it could last forever: ArenaFull instead. ValueError if `nbytes` would
        not fit even an empty ring."""
        n = -(-max(nbytes, 1) // ALIGN) * ALIGN
        with self._cond:
            r = self._rings[ring]
            if n > r.capacity:
                raise ValueError(f"{nbytes} bytes do not fit the writer's buffer of {r.capacity} bytes")
            while True:
                if self._closed is not None:
                    raise WriterGone(self._closed)
                at = r.place(n)
                if at is not None:
                    block = [at, n, 0, 0]
                    r.blocks.append(block)
                    r.index[at] = block
                    return at
                if not r.waiting_helps():
                    raise ArenaFull(f"{nbytes} bytes: the writer's buffer is full of batches not sent yet")
                self._cond.wait()

    def mark_sent(self, offsets: list[int]) -> None:
        """These blocks are in a batch the child has: its outcome frees them."""
        with self._cond:
            for offset in offsets:
                for r in set(self._rings.values()):
                    block = r.index.get(offset)
                    if block is not None:
                        block[3] = 1

    def free(self, offset: int) -> None:
        with self._cond:
            for r in set(self._rings.values()):
                if r.free(offset):
                    self._cond.notify_all()
                    return

    def in_use(self) -> int:
        with self._cond:
            return sum(b[1] for r in set(self._rings.values()) for b in r.blocks)

    def close(self, reason: str) -> None:
        """No more frees will come: wake anyone waiting for space (they raise WriterGone)."""
        with self._cond:
            if self._closed is None:
                self._closed = reason
            self._cond.notify_all()

    # -- views (both processes) ------------------------------------------------------------
    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.whole[offset : offset + numel * itemsize].view(dtype).view(shape)

    def empty(self, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[torch.Tensor], int]:
        """Tensors of these (shape, dtype)s in one new block of the device's ring (freed with
        `free(block)`): the tensors and the block."""
        sizes = []
        for shape, dtype in specs:
            numel = 1
            for d in shape:
                numel *= d
            sizes.append(-(-(numel * torch.empty((), dtype=dtype).element_size()) // ALIGN) * ALIGN)
        block = self.alloc(sum(sizes), DEVICE)
        out, at = [], block
        for (shape, dtype), size in zip(specs, sizes, strict=True):
            out.append(self.tensor(at, dtype, tuple(shape)))
            at += size
        return out, block

    def at(self, place: Place) -> torch.Tensor:
        """The tensor at a Place (offset, shape, dtype name), as the other process put it there."""
        offset, shape, dtype = place
        return self.tensor(offset, getattr(torch, dtype), shape)

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Where a contiguous CPU tensor lies in the arena, or None if it is not in it."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        start = t.data_ptr() - self.address
        if HEADER <= start and start + t.numel() * t.element_size() <= self.size:
            return start
        return None

    def set_flag(self, which: int) -> None:
        self.mm[which] = 1

    def flag(self, which: int) -> bool:
        return self.mm[which] != 0

    # -- pinning (this process, after CUDA is up) ------------------------------------------
    def register_cuda(self, device: torch.device) -> str | None:
        """Page-lock the arena for CUDA (cudaHostRegister, portable: pinned for every device's
        context), so copies from `device` land in it without a staging buffer and without
        blocking; the error's text if that failed."""
        try:
            with torch.cuda.device(device):
                err = torch.cuda.cudart().cudaHostRegister(
                    self.address + HEADER, self.capacity, _REGISTER_PORTABLE
                )
        except Exception as e:  # no CUDA runtime binding in this torch
            return f"{type(e).__name__}: {e}"
        code = int(getattr(err, "value", err))
        if code != 0:
            return f"cudaHostRegister error {code}"
        self.registered, self.device = True, device
        return None

    def release(self) -> None:
        """Unpin (after the device's copies into it are done); the mapping goes when its last
        view does."""
        if self.registered:
            self.registered = False
            with torch.cuda.device(self.device):
                torch.cuda.synchronize(self.device)
                torch.cuda.cudart().cudaHostUnregister(self.address + HEADER)


def copy_into(arena: Arena, *tensors: torch.Tensor) -> tuple[int, list[int]]:
    """Copy CPU tensors into one new block of the arena: (the block, each tensor's offset).
    NumPy, one thread, GIL released for large copies (a torch copy here would start an OpenMP
    team beside the forward's)."""
    sources = [t.contiguous() for t in tensors]
    sizes = [-(-(t.numel() * t.element_size()) // ALIGN) * ALIGN for t in sources]
    block = arena.alloc(sum(sizes))
    offsets = []
    at = block
    for src, size in zip(sources, sizes, strict=True):
        nbytes = src.numel() * src.element_size()
        if nbytes:
            dst = arena.whole[at : at + nbytes].numpy()
            numpy.copyto(dst, src.reshape(-1).view(torch.uint8).numpy())
        offsets.append(at)
        at += size
    return block, offsets


def _receive(f: Any) -> Any:
    """The next message, or None at the end of the pipe (the other side has gone)."""
    head = f.read(FRAME.size)
    if len(head) < FRAME.size:
        return None
    (n,) = FRAME.unpack(head)
    payload = f.read(n)
    if len(payload) < n:
        return None
    return pickle.loads(payload)


def _widen(fd: int) -> None:
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except (OSError, AttributeError):  # a smaller limit here: the writes just wait more often
        pass


class WriterProcess:
    """The forked writer: `submit` batches, read `outcomes()`, then `end()` and `wait()`."""

    def __init__(self, publisher: BatchPublisher, arena: Arena, threads: int, drain_threads: int):
        self.arena = arena
        cmd_r, cmd_w = os.pipe()
        res_r, res_w = os.pipe()
        _widen(cmd_w)
        # As for the tokenizer (childgen.py): a full collection here would write to every object
        # from before the fork and so copy each page still shared with the child. Thawed by close().
        self._thaw = gc.get_freeze_count() == 0
        gc.freeze()
        parent = os.getpid()
        try:
            pid = os.fork()
        except OSError:
            for fd in (cmd_r, cmd_w, res_r, res_w):
                os.close(fd)
            if self._thaw:
                gc.unfreeze()
            raise
        if pid == 0:  # the child: never returns into the caller's code
            os.close(cmd_w)
            os.close(res_r)
            _child(publisher, arena, cmd_r, res_w, threads, drain_threads, parent)
        os.close(cmd_r)
        os.close(res_w)
        self.pid: int | None = pid
        self._cmd = cmd_w
        self._results = os.fdopen(res_r, "rb")
        self._lock = threading.Lock()
        self._status = ""

    def submit(self, batch_id: int, items: list[WireItem]) -> None:
        """Send a batch."""
        try:
            send_message(self._cmd, ("batch", batch_id, items))
        except BrokenPipeError:
            raise WriterGone(f"the writer process has gone ({self.wait()})") from None

    def end(self) -> None:
        """No more batches: the child finishes what it has, says goodbye and exits."""
        try:
            send_message(self._cmd, ("end",))
        except OSError:
            pass
        finally:
            os.close(self._cmd)
            self._cmd = -1

    def outcomes(self) -> Iterator[tuple[int, Outcome]]:
        """(batch id, outcome) as the child sends them, until its goodbye; WriterGone if it
        failed or died first."""
        while True:
            msg = _receive(self._results)
            if msg is None:
                raise WriterGone(f"the writer process ended without finishing ({self.wait()})")
            if msg[0] == "done":
                yield msg[1], msg[2]
            elif msg[0] == "failed":
                raise WriterGone(f"the writer process failed: {msg[1]}")
            else:  # "bye"
                return

    def kill(self) -> None:
        with self._lock:
            if self.pid is not None:
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def wait(self) -> str:
        """Collect the child (once) and say how it ended."""
        with self._lock:
            if self.pid is not None:
                self._status = reap(self.pid)
                self.pid = None
            return self._status

    def close(self) -> None:
        """Kill the child if it still runs (an error path), collect it, close the pipes."""
        self.kill()
        self.wait()
        if self._cmd >= 0:
            os.close(self._cmd)
            self._cmd = -1
        self._results.close()
        if self._thaw:
            self._thaw = False
            gc.unfreeze()


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _child(
    publisher: BatchPublisher, arena: Arena, cmd_r: int, res_w: int, threads: int, drain: int, parent: int
) -> None:
    global _in_writer
    _in_writer = True
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _die_with_parent()
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(1)
        torch.set_num_threads(1)  # no torch op here needs a team (and OpenMP is not fork-safe)
        try:
            _serve(publisher, arena, os.fdopen(cmd_r, "rb"), res_w, threads, drain)
        except BrokenPipeError:
            code = 1
        except BaseException as e:  # a bug: told to the parent, which ends the run as failed
            send_message(res_w, ("failed", f"{type(e).__name__}: {e}"))
            code = 1
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _serve(
    publisher: BatchPublisher, arena: Arena, commands: Any, res_w: int, threads: int, drain: int
) -> None:
    def stopped() -> bool:
        return arena.flag(FLAG_ABANDON)

    try:
        while True:
            msg = _receive(commands)
            if msg is None:  # the parent has gone
                return
            if msg[0] == "end":
                send_message(res_w, ("bye",))
                return
            _, batch_id, wire = msg
            items = [w.item(arena) for w in wire]
            n = max(threads, drain) if arena.flag(FLAG_DRAIN) else threads
            outcome = Outcome() if stopped() else publisher.publish(items, n, stopped)
            del items  # views of the arena: the parent reuses the space once it has the outcome
            send_message(res_w, ("done", batch_id, outcome))
    finally:
        publisher.close()
