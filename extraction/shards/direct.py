"""A shard's bytes staged in an aligned buffer and written with O_DIRECT: no page cache for them.

Why (#49 item 6, docs/benchmarks.md): a shard is written once and read by training much later, so
its bytes gain nothing from the page cache, and on a loaded machine the cache is what costs: on the
dev VM a buffered write to ext4 took 2.8-2.9 s of CPU a GiB under load (page allocation, reclaim,
writeback), the same write with O_DIRECT 0.04 s, at the disk's rate (1.0-1.4 GB/s there). The
sglang client's states come from the dump files (extraction/shards/filebytes.py): read straight
into this buffer (one copy), their CRC32 and NaN/Inf check taken there, then handed to the disk.

Contract:
- `DirectSink(fd)`: for a file just created and empty, opened for writing; `direct` says whether
  O_DIRECT could be set on it (F_SETFL; a file system that refuses it gets ordinary writes from
  the same buffer, as does the rest of a file after a direct write fails with EINVAL or comes
  back short). The staging buffer is the calling thread's own (STAGING + ALIGN bytes, page
  aligned, reused): one sink per thread at a time.
- `put(data)`: bytes appended; `room(n)`: a writable view of exactly n (<= CHUNK_ROOM) bytes at
  the end, filled by the caller and then counted with `advance(n)`.
- `finish()`: everything written (aligned blocks directly, the tail of under ALIGN bytes with
  O_DIRECT cleared); the caller fsyncs as for any file. OSError from the writes as they come.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading

ALIGN = 4096  # O_DIRECT's offset, length and address unit (a logical block is 512 or 4096 bytes)
STAGING = 8 << 20  # bytes handed to the disk at a time (the write waits for the device)
CHUNK_ROOM = 1 << 20  # the most room() gives at once (the copy's 1 MiB reads)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_tls = threading.local()


def _staging() -> memoryview:
    """The thread's page-aligned staging buffer (anonymous mapping: aligned by construction)."""
    view = getattr(_tls, "view", None)
    if view is None:
        _tls.map = mmap.mmap(-1, STAGING + ALIGN)
        view = _tls.view = memoryview(_tls.map)
    return view


def set_direct(fd: int, on: bool) -> bool:
    """O_DIRECT set (or cleared) on `fd`: whether it took."""
    if not _O_DIRECT:
        return False
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | _O_DIRECT) if on else (flags & ~_O_DIRECT))
    except OSError:
        return False
    return True


class DirectSink:
    """See the module's contract."""

    def __init__(self, fd: int):
        self.fd = fd
        self.view = _staging()
        self.fill = 0
        self.direct = set_direct(fd, True)

    def room(self, n: int) -> memoryview:
        if n > CHUNK_ROOM:
            raise ValueError(f"room for {n} bytes asked, {CHUNK_ROOM} at most")
        if len(self.view) - self.fill < n:
            self._flush()
        return self.view[self.fill : self.fill + n]

    def advance(self, n: int) -> None:
        self.fill += n

    def put(self, data: memoryview | bytes) -> None:
        data = memoryview(data).cast("B")
        while data:
            if self.fill == len(self.view):
                self._flush()
            n = min(len(data), len(self.view) - self.fill)
            self.view[self.fill : self.fill + n] = data[:n]
            self.fill += n
            data = data[n:]

    def finish(self) -> None:
        self._flush()
        if self.fill:
            if self.direct:
                self.direct = False
                set_direct(self.fd, False)
            self._write(self.view[: self.fill])
            self.fill = 0

    def _flush(self) -> None:
        """The aligned part of what is staged written; the tail (< ALIGN bytes) moved to the front."""
        aligned = self.fill - self.fill % ALIGN
        if not aligned:
            return
        self._write(self.view[:aligned])
        tail = self.fill - aligned
        self.view[:tail] = self.view[aligned : self.fill]  # tail < ALIGN <= aligned: no overlap
        self.fill = tail

    def _write(self, view: memoryview) -> None:
        while view:
            try:
                n = os.write(self.fd, view)
            except OSError as exc:
                if self.direct and exc.errno == errno.EINVAL:  # not for this file after all
                    self.direct = False
                    set_direct(self.fd, False)
                    continue
                raise
            if n <= 0:
                raise OSError(errno.EIO, f"a write to fd {self.fd} wrote nothing")
            if n < len(view) and self.direct:  # short: the rest is no longer aligned
                self.direct = False
                set_direct(self.fd, False)
            view = view[n:]
