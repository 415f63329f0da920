"""glibc's malloc, told to keep what a CPU forward pass frees for the next batch.

Why: on a CPU every op of the forward allocates its output with malloc, and glibc gives blocks
of more than 128 KiB back to the kernel when they are freed (munmap, or a trim of the heap's
top), so the next batch faults every page in again: 640k-920k minor faults over the tiny model's
384-sample benchmark (17k a batch), each a kernel entry that zeroes a page, and munmap takes the
process's mmap lock, which the forward's OpenMP team then queues on. With the blocks kept, the
same loop faults ~300 times: 2.18-2.30 s -> 1.34-1.49 s a round on the 16-core host (in two of
three calls; 1.48 -> 1.39 s in the third), 2.2-2.4 -> 1.4-1.7 s on the 2-core dev machine.
tests/bench/bench_runner.py prints it before its rounds ("glibc's default malloc").

The cost: the process keeps its peak heap (what one batch's forward needs at once) until it
exits. Blocks over MMAP_THRESHOLD are still mapped for themselves. Process-wide and not undone
(glibc has no getter to restore from), set once, before the helper processes are forked so they
keep theirs too. Not glibc (musl, macOS), or HSX_MALLOC_TUNE=0: nothing changes.
"""

from __future__ import annotations

import ctypes
import os

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 1 << 30

_done: bool | None = None


def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc and tuning is wanted (HSX_MALLOC_TUNE != 0)."""
    if os.environ.get("HSX_MALLOC_TUNE", "1") == "0":
        return None
    try:
        return ctypes.CDLL(None) if os.confstr("CS_GNU_LIBC_VERSION") else None
    except (ValueError, OSError, AttributeError):  # no confstr name (macOS), not glibc (musl)
        return None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True where they now are."""
    global _done
    if _done is None:
        libc = _glibc()
        _done = (
            libc is not None
            and bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
            and bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        )
    return _done


def release_free_memory() -> None:
    """Hand what malloc holds free back to the kernel (malloc_trim) before a fork: pages left in
    the heap would be shared with the child, and the forward's first write to each of them after
    the fork would copy it (a fault and a TLB flush across every thread of this process)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
