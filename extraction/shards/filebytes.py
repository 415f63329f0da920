"""A tensor's bytes left in files, never read into a tensor: copied into a shard as it is written.

The sglang path (#38, #49; docs/benchmarks.md "the client after #49 item 6"): a dump's states are
exactly the shard's bytes. Read into memory of the client (pread) and written from there, every byte crosses
user space twice through a buffer as large as the sample (fresh pages: faults and zeroing); mapped
(as before #38), a dump that shrinks under the client is a SIGBUS that kills it. `FileBytes` is
neither: the states stay in their files, and the shard writer copies them through one small
buffer per thread (CHUNK bytes, reused: it stays in the core's cache), taking the CRC32 the zip
records need of exactly the bytes it writes. A file that is shorter than it was when opened gives
a short read: the error of that sample (`FileBytes.error`), never a signal; the shard's temp is
removed by the writer. Measured alternatives (tests/bench/bench_dump_copy.py, docs/benchmarks.md):
a CRC pass, then sendfile (0.62 s of CPU a GiB), costs more than this one pass (0.48); a CRC the
hook would compute (zlib in the server, 0.26 s/GiB) moves the cost to the GPU host's CPU and is a
claim the client could not check against the bytes.

Finiteness is checked here, on the bytes themselves (`check`, the dump reader always sets it): the
copy's buffer is in the core's cache, and a masked max over the exponent bits of its values costs
~0.07 s of one core a GiB (numpy, one thread; `torch.isfinite(t).all()` over a whole sample, #38's
check, took 1.46). So no header has to be believed: the hook's `finite` field (hsx_dump_format)
only lets the client refuse a piece early, and a NaN/Inf under a header that says finite is found
in the copy all the same (NonFiniteBytes naming the file and the byte), the shard's temp removed.
Why not sendfile/copy_file_range: the CRC32 and this check need the bytes in user space anyway;
read once into the buffer, the write from it costs what an in-kernel copy would (measured:
tests/bench/bench_dump_copy.py), and a second pass (a CRC read, then sendfile) costs more.

Contract:
- `FileBytes(dtype, shape, spans, error, check)`: the C-contiguous tensor of `shape` x `dtype` whose
  bytes are the spans' bytes in order; each span (OpenFile, offset, length). The OpenFiles own
  their descriptors (closed when the last FileBytes or holder of them goes).
- `copy_to(out, crc32, crc)`: write the bytes to `out` (a descriptor, at its position, or a
  DirectSink: extraction/shards/direct.py, read straight into its buffer), return the running
  CRC32 of them started from `crc`; `error(message)` raised when a file ends early (nothing is
  retried; the message names the file, where it ended and its size when opened), OSError from the
  writes as they come; with `check`, NonFiniteBytes at the first chunk holding a NaN/Inf (the
  chunks before it are written: the caller removes the file it was writing).
- `read()`: the tensor itself, in memory of ours (a path that needs the values: another dtype,
  torch.save), checked the same way with `check`.
- `first_nonfinite(view, dtype)`: the index of the first NaN/Inf element of a buffer, or None.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy
import torch

from extraction.shards.direct import CHUNK_ROOM, DirectSink

CHUNK = CHUNK_ROOM  # the copy's reads (1 MiB): small enough to stay in the core's cache for the CRC
_tls = threading.local()  # one buffer (and the check's scratch) per writer thread
# A float is NaN/Inf when its exponent bits are all ones: (integer view, exponent mask) a dtype.
EXPONENT_MASKS: dict[torch.dtype, tuple[type, int]] = {
    torch.bfloat16: (numpy.int16, 0x7F80),
    torch.float16: (numpy.int16, 0x7C00),
    torch.float32: (numpy.int32, 0x7F800000),
}


class NonFiniteBytes(ValueError):
    """A NaN/Inf among a FileBytes' values (`check`): the message names the file and the byte."""

    key: str | None = None  # the payload's key, set by the shard writer for its message


class OpenFile:
    """A read-only descriptor and the path it was opened from (for messages); closed with its last
    holder."""

    def __init__(self, fd: int, path: str, size: int):
        self.fd, self.path, self.size = fd, path, size
        self._closer = weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        self._closer()


@dataclass(frozen=True)
class FileBytes:
    """A tensor whose bytes are spans of files (see the module's contract)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    spans: tuple[tuple[OpenFile, int, int], ...]
    error: Callable[[str], Exception] = ValueError
    check: bool = False  # refuse NaN/Inf values as they are copied or read (NonFiniteBytes)

    def __post_init__(self) -> None:
        if self.check and self.dtype not in EXPONENT_MASKS:
            raise ValueError(f"no NaN/Inf check for {self.dtype}")
        want = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            want *= d
        if sum(n for _f, _at, n in self.spans) != want:
            raise ValueError(f"spans of {self.nbytes} bytes for a {self.dtype}{list(self.shape)} tensor")

    @property
    def nbytes(self) -> int:
        return sum(n for _f, _at, n in self.spans)

    def dim(self) -> int:
        return len(self.shape)

    def reshaped(self, shape: tuple[int, ...]) -> FileBytes:
        """The same bytes as a tensor of `shape` (same number of elements)."""
        return replace(self, shape=tuple(shape))

    def copy_to(self, out: int | DirectSink, crc32: Callable[..., int], crc: int = 0) -> int:
        """Write the bytes to `out` (a descriptor, at its position, or a DirectSink: read straight
        into its staging buffer); their CRC32 continued from `crc` (see the contract)."""
        sink = out if isinstance(out, DirectSink) else None
        buf = getattr(_tls, "buf", None)
        if buf is None and sink is None:
            buf = _tls.buf = memoryview(bytearray(CHUNK))
        for src, at, n in self.spans:
            done = 0
            while done < n:
                want = min(CHUNK, n - done)
                region = sink.room(want) if sink is not None else buf[:want]
                got = self._fill(src, region, at + done, "copied")
                crc = crc32(region, crc)
                if self.check:
                    self._check(region, src, at + done)
                if sink is not None:
                    sink.advance(got)
                else:
                    put = 0
                    while put < got:
                        put += os.write(out, region[put:got])
                done += got
        return crc

    def _fill(self, src: OpenFile, into: memoryview, at: int, doing: str) -> int:
        """`into` filled from `src` at `at` (whole elements, so the check sees no split value):
        its length; `error` when the file ends first."""
        got = 0
        while got < len(into):
            n = _pread(src, into[got:], at + got, self.error)
            if n <= 0:
                raise self.error(
                    f"{src.path}: the file ends at byte {at + got}, {src.size} when it was opened "
                    f"(it shrank while being {doing})"
                )
            got += n
        return got

    def _check(self, view: memoryview, src: OpenFile, at: int) -> None:
        """NonFiniteBytes when `view` (the bytes of `src` from `at`) holds a NaN/Inf."""
        bad = first_nonfinite(view, self.dtype)
        if bad is not None:
            size = torch.empty((), dtype=self.dtype).element_size()
            kind = str(self.dtype).removeprefix("torch.")
            raise NonFiniteBytes(f"{src.path}: a NaN or Inf {kind} value at byte {at + bad * size}")

    def read(self) -> torch.Tensor:
        """The tensor, read (pread) into memory of ours; its values checked with `check`."""
        out = torch.empty(self.nbytes, dtype=torch.uint8)
        view = (
            memoryview((ctypes.c_ubyte * self.nbytes).from_address(out.data_ptr())).cast("B")
            if self.nbytes
            else None
        )
        pos = 0
        for src, at, n in self.spans:
            if not n:
                continue
            self._fill(src, view[pos : pos + n], at, "read")
            if self.check:
                for i in range(0, n, CHUNK):  # in chunks: the check's scratch stays small
                    self._check(view[pos + i : pos + min(n, i + CHUNK)], src, at + i)
            pos += n
        return out.view(self.dtype).view(self.shape)


def first_nonfinite(view: memoryview, dtype: torch.dtype) -> int | None:
    """The index of the first NaN/Inf `dtype` element in `view` (whole elements), or None: a
    masked max over the exponent bits, in numpy (one thread: no OpenMP team beside the caller's),
    into a scratch buffer reused by the thread."""
    itype, mask = EXPONENT_MASKS[dtype]
    bits = numpy.frombuffer(view, dtype=itype)
    if not bits.size:
        return None
    scratch = getattr(_tls, "scratch", None)
    if scratch is None or scratch.nbytes < bits.nbytes:
        scratch = _tls.scratch = numpy.empty(max(CHUNK, bits.nbytes), dtype=numpy.uint8)
    exponents = numpy.bitwise_and(bits, mask, out=scratch[: bits.nbytes].view(itype))
    if int(exponents.max()) != mask:
        return None
    return int(numpy.flatnonzero(exponents == mask)[0])


def _pread(src: OpenFile, into: memoryview, at: int, error: Callable[[str], Exception]) -> int:
    """pread into `into` from `src` at `at`: the bytes read; a read error (the dump's disk) is
    `error`, the sample's, not an OSError the shard writer would take for its own disk's."""
    try:
        return os.preadv(src.fd, [into], at)
    except OSError as exc:
        raise error(f"{src.path}: read error at byte {at}: {exc}") from None


def in_memory(t: torch.Tensor | FileBytes) -> torch.Tensor:
    """`t` itself, or a FileBytes read into memory."""
    return t.read() if isinstance(t, FileBytes) else t
