"""extraction/process/heap.py: malloc keeps what it frees (no fault per reuse), and hands it back when asked.

Each case runs in a child interpreter: the setting is process-wide and cannot be undone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not hasattr(os, "confstr") or not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc only"
)

_PROBE = r"""
import ctypes, resource, sys
from extraction.process import heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

tuned = heap.keep_freed_memory()
# A batch's ops: 8 outputs of 1 MiB alive at once, then all freed. glibc's default returns
# them to the kernel (unmapped, or trimmed off the heap's top once its threshold has risen).
size = 1 << 20
f0 = faults()
for _ in range(50):
    outs = [libc.malloc(size) for _ in range(8)]
    for p in outs:
        ctypes.memset(p, 1, size)  # every page touched, as an op's output is
    for p in reversed(outs):
        libc.free(p)
reuse = faults() - f0
# 64 MiB in 256 KiB blocks, all freed: kept in the heap when tuned, until released
blocks = [libc.malloc(256 << 10) for _ in range(256)]
for p in blocks:
    ctypes.memset(p, 1, 256 << 10)
for p in reversed(blocks):
    libc.free(p)
held = rss_kib()
heap.release_free_memory()
print(tuned, reuse, held, rss_kib())
"""


def _probe(tune: bool) -> tuple[bool, int, int, int]:
    env = {**os.environ, "HSX_MALLOC_TUNE": "1" if tune else "0"}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    return out[0] == "True", int(out[1]), int(out[2]), int(out[3])


def test_kept_memory_is_reused_without_faulting_again() -> None:
    tuned, reuse, _, _ = _probe(True)
    untuned, reuse_default, _, _ = _probe(False)
    assert tuned and not untuned
    # glibc's default: the 8 MiB faulted in again each round (2048 faults); kept: the first only
    assert reuse * 10 < reuse_default, (reuse, reuse_default)


def test_release_hands_the_kept_heap_back() -> None:
    _, _, held, after = _probe(True)
    assert held - after > 32 << 10, (held, after)  # KiB: most of the 64 MiB kept goes back
