"""A tensor's bytes left in files, never read into a tensor: copied into a shard as it is written.

The sglang path (#38, docs/benchmarks.md "the client after #38"): a dump's states are exactly the
shard's bytes. Read into memory of the client (pread) and written from there, every byte crosses
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

Contract:
- `FileBytes(dtype, shape, spans, error)`: the C-contiguous tensor of `shape` x `dtype` whose bytes
  are the spans' bytes in order; each span (OpenFile, offset, length). The OpenFiles own their
  descriptors (closed when the last FileBytes or holder of them goes).
- `copy_to(out_fd, crc32, crc)`: write the bytes to `out_fd` at its position, return the running
  CRC32 of them started from `crc`; `error(message)` raised when a file ends early (nothing is
  retried), OSError from the writes as they come.
- `read()`: the tensor itself, in memory of ours (a path that needs the values: another dtype,
  torch.save, a NaN check).
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

CHUNK = 1 << 20  # the copy's buffer: small enough to stay in the core's cache between read and write
_tls = threading.local()  # one buffer per writer thread


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

    def __post_init__(self) -> None:
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

    def copy_to(self, out_fd: int, crc32: Callable[..., int], crc: int = 0) -> int:
        """Write the bytes to `out_fd`; their CRC32 continued from `crc` (see the contract)."""
        buf = getattr(_tls, "buf", None)
        if buf is None:
            buf = _tls.buf = memoryview(bytearray(CHUNK))
        for src, at, n in self.spans:
            done = 0
            while done < n:
                got = _pread(src, buf[: min(CHUNK, n - done)], at + done, self.error)
                if got <= 0:
                    raise self.error(
                        f"{src.path}: the file ends at byte {at + done}, {src.size} when it was opened "
                        "(it shrank while being copied)"
                    )
                crc = crc32(buf[:got], crc)
                put = 0
                while put < got:
                    put += os.write(out_fd, buf[put:got])
                done += got
        return crc

    def read(self) -> torch.Tensor:
        """The tensor, read (pread) into memory of ours."""
        out = torch.empty(self.nbytes, dtype=torch.uint8)
        view = (
            memoryview((ctypes.c_ubyte * self.nbytes).from_address(out.data_ptr())).cast("B")
            if self.nbytes
            else None
        )
        pos = 0
        for src, at, n in self.spans:
            done = 0
            while done < n:
                got = _pread(src, view[pos + done : pos + n], at + done, self.error)
                if got <= 0:
                    raise self.error(
                        f"{src.path}: the file ends at byte {at + done}, {src.size} when it was opened "
                        "(it shrank while being read)"
                    )
                done += got
            pos += n
        return out.view(self.dtype).view(self.shape)


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
