"""Tensors that are views of a file's pages, and the file range behind a buffer of them.

A sample on the sglang path arrives as a dump file the server wrote (in RAM, /run/hsx-dumps by
default) whose tensor bytes are exactly the shard's. Written with write(2) from a mapping, every
byte is copied by the CPU from the mapped pages into the shard file's page cache, through the
mapping's page tables; sendfile(2) from the dump's descriptor moves the same bytes page cache to
page cache inside the kernel. On the dev machine, for a 212 MB sample into ext4, that is 94 ms of
system time instead of 194 (dd's own write costs the latter): the client's largest CPU cost per
byte, halved (docs/benchmarks.md, issue #29).

Since issue #38 the dump reader (extraction/sglang/dumps.py) reads dumps with pread instead: a
mapped file that shrinks under the client, or a disk read error behind a mapping, is a SIGBUS
that kills the client, not an error of one sample. Nothing on the product path makes a
MappedFile now; `file_range` finds nothing there and the shard writer writes the bytes. Only a
file that nobody else can shrink and whose disk cannot fail a read (a sealed memfd) may be mapped.

Contract:
- `MappedFile(fd)` maps the whole regular file `fd` privately (copy on write: a write into a
  tensor never reaches the file) and takes the descriptor: it is closed when the mapping goes,
  i.e. when neither the MappedFile nor any tensor made from it is left.
- `MappedFile.tensor(dtype, shape, at)`: a view of the bytes at offset `at` (no copy).
- `file_range(view)`: (descriptor, offset) of a buffer whose bytes lie wholly inside a live
  MappedFile (a view of one of its tensors, as the shard writer makes them), else None. The
  descriptor stays open while the buffer's tensor lives; the caller copies from it with sendfile.
  The bytes at that range are the mapped bytes as long as nobody writes the file itself: dumps
  are written once under a temp name and renamed; the mapping is private, so a tensor written
  into (nothing does) would differ from the file - and from the CRC the shard writer took of the
  mapped bytes, which verification would then catch.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref

import torch

_lock = threading.Lock()
_live: dict[int, _Range] = {}  # base address -> the mapping there


class _Range:
    __slots__ = ("base", "size", "fd")

    def __init__(self, base: int, size: int, fd: int):
        self.base, self.size, self.fd = base, size, fd


class MappedFile:
    """A regular file mapped whole and privately, its descriptor owned (see the module's contract)."""

    def __init__(self, fd: int):
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        except BaseException:
            os.close(fd)
            raise
        self.size = size
        self._bytes = torch.frombuffer(mm, dtype=torch.uint8)  # holds the mapping
        entry = _Range(self._bytes.data_ptr(), size, fd)
        with _lock:
            # A mapping that overlaps is gone (munmap runs before its weakref callbacks): forget it.
            for base in [b for b, r in _live.items() if b < entry.base + size and entry.base < b + r.size]:
                del _live[base]
            _live[entry.base] = entry
        weakref.finalize(mm, _forget, entry)

    def tensor(self, dtype: torch.dtype, shape: list[int], at: int) -> torch.Tensor:
        """The `shape` x `dtype` tensor whose bytes start at offset `at` (a view of the mapping;
        `at` a multiple of the dtype's size)."""
        n = torch.empty((), dtype=dtype).element_size()
        for d in shape:
            n *= d
        if at < 0 or at + n > self.size:
            raise ValueError(f"bytes {at}..{at + n} lie outside the file's {self.size}")
        return self._bytes[at : at + n].view(dtype).view(shape)


def _forget(entry: _Range) -> None:
    with _lock:
        if _live.get(entry.base) is entry:
            del _live[entry.base]
    os.close(entry.fd)


def file_range(view: memoryview) -> tuple[int, int] | None:
    """(descriptor, offset) of `view`'s bytes inside a live MappedFile, or None."""
    if not _live or not len(view):
        return None
    try:
        address = ctypes.addressof(ctypes.c_ubyte.from_buffer(view))
    except (TypeError, ValueError):  # read-only (bytes): not a tensor's view
        return None
    with _lock:
        for base, r in _live.items():
            if base <= address and address + len(view) <= base + r.size:
                return r.fd, address - base
    return None
