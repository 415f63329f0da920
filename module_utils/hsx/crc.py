"""CRC32 for the `full` level: a checked fast backend when one is installed, crc_check, crc32_combine.

The backend is chosen once at import (HSX_CRC32 or the first that works) and may be switched
with use_crc_backend; active_crc32 gives the functions in use to other code that checksums
shards (the writer's torch zip layout), so that everything agrees on one implementation.
"""

from __future__ import annotations

import importlib
import os
import threading
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from .errors import ShardBad
from .ziprecords import ZipRecord

if TYPE_CHECKING:  # annotations only: verify.check imports this module
    from .verify.check import ShardInfo

_CHUNK = 1 << 20  # CRC pass reads: a reused 1 MiB buffer stays in the core's cache between read and CRC
_DIRECT_CRC_MAX = 64 << 10  # up to this size a second CRC pass is cheaper than combining per region


def _crc_agrees(crc32: Callable[..., int], combine: Callable[[int, int, int], int] | None) -> bool:
    """A candidate CRC32 gives zlib's answers (values, start values, memoryviews, combine)."""
    samples = [b"", b"\x00", bytes(range(256)) * 41 + b"abc", bytes(70_001)]
    try:
        for i, data in enumerate(samples):
            for start in (0, 0x9E3779B9 >> i):
                if crc32(memoryview(data), start) != zlib.crc32(data, start):
                    return False
        if combine is not None:
            a, b = samples[2], samples[3]
            if combine(zlib.crc32(a), zlib.crc32(b), len(b)) != zlib.crc32(a + b):
                return False
    except Exception:  # an unusable library is no library
        return False
    return True


def _crc_backend(choice: str | None = None) -> tuple[str, Callable[..., int], Callable[..., int] | None]:
    """(name, crc32, crc32_combine or None): zlib, or a faster drop-in when one is installed.

    `full` is bound by CRC32 speed. ISA-L (`pip install isal`) and zlib-ng (`pip install
    zlib-ng`) use carry-less multiplication, faster than zlib's (docs/benchmarks.md). Both are
    optional: a library is used only after it reproduces zlib's results here,
    so a host without them (or with a broken build) verifies with zlib, which is always correct.
    HSX_CRC32=zlib|isal|zlib-ng|auto picks one (default auto: the first that works).
    """
    choice = (choice or os.environ.get("HSX_CRC32") or "auto").lower()
    candidates = [("isal", "isal.isal_zlib"), ("zlib-ng", "zlib_ng.zlib_ng")]
    for name, module in candidates:
        if choice not in ("auto", name):
            continue
        try:
            lib = importlib.import_module(module)
        except Exception:  # absent or unloadable on this host
            continue
        crc32, combine = getattr(lib, "crc32", None), getattr(lib, "crc32_combine", None)
        if callable(crc32) and _crc_agrees(crc32, combine if callable(combine) else None):
            return name, crc32, combine if callable(combine) else None
    return "zlib", zlib.crc32, None


CRC32_BACKEND, _crc32, _crc32_combine_lib = _crc_backend()
_tls = threading.local()  # one reusable read buffer per thread for crc_check


def active_crc32() -> tuple[Callable[..., int], Callable[[int, int, int], int] | None]:
    """(crc32, the backend's own crc32_combine or None) of the backend in use now."""
    return _crc32, _crc32_combine_lib


def use_crc_backend(choice: str) -> str:
    """Switch the CRC32 implementation (tests, benchmarks); returns the name now in use."""
    global CRC32_BACKEND, _crc32, _crc32_combine_lib
    CRC32_BACKEND, _crc32, _crc32_combine_lib = _crc_backend(choice)
    return CRC32_BACKEND


def crc_check(fd: int, info: ShardInfo, buf: bytearray | None = None) -> int:
    """`full`: CRC32 of every record against the zip directory, in one sequential pass.

    Returns the whole file's CRC32, built from the same pass with crc32_combine so each byte
    is checksummed once (the index stores the whole-file CRC).
    """
    crc32 = _crc32
    combine = _crc32_combine_lib or crc32_combine
    if info.data is not None:  # small file, already in memory from the structure check
        view = memoryview(info.data)
        chunk = len(info.data)
    else:
        chunk = min(_CHUNK, info.size)
        if buf is None or len(buf) < chunk:
            buf = getattr(_tls, "buf", None)
            if buf is None or len(buf) < chunk:
                buf = _tls.buf = bytearray(max(chunk, _CHUNK))
        view = memoryview(buf)
    # Regions in file order: (start, end, record or None for the bytes between records).
    regions: list[tuple[int, int, ZipRecord | None]] = []
    cursor = 0
    for rec in sorted(info.records, key=lambda r: r.data_offset):
        if rec.data_offset > cursor:
            regions.append((cursor, rec.data_offset, None))
        regions.append((rec.data_offset, rec.data_offset + rec.size, rec))
        cursor = rec.data_offset + rec.size
    if cursor < info.size:
        regions.append((cursor, info.size, None))
    if hasattr(os, "posix_fadvise") and info.size > _CHUNK:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    direct = info.size <= _DIRECT_CRC_MAX  # small file: a second CRC pass is cheaper than combining
    whole = 0
    ri = 0
    region_crc = 0
    pos = 0
    while pos < info.size:
        n = info.size if info.data is not None else os.preadv(fd, [view[: min(chunk, info.size - pos)]], pos)
        if n <= 0:
            raise ShardBad(f"file shrank while reading (at byte {pos} of {info.size})")
        chunk_start, chunk_end = pos, pos + n
        if direct:
            whole = crc32(view[:n], whole)
        while ri < len(regions) and regions[ri][0] < chunk_end:
            start, end, rec = regions[ri]
            a, b = max(start, chunk_start), min(end, chunk_end)
            region_crc = crc32(view[a - chunk_start : b - chunk_start], region_crc)
            if end > chunk_end:
                break
            if rec is not None and region_crc != info.crc_of(rec):
                raise ShardBad(f"record {rec.name!r}: CRC32 mismatch (data damaged)")
            if not direct:
                whole = combine(whole, region_crc, end - start)
            region_crc = 0
            ri += 1
        pos = chunk_end
    return whole


# GF(2) polynomial arithmetic for crc32_combine (zlib's algorithm; Python's zlib lacks it).
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _bit in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()
_SHIFT_OPS: dict[int, int] = {}  # len2 -> x^(8*len2) mod P: records of a run repeat their lengths


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of A+B from crc32(A), crc32(B) and len(B)."""
    if len2 <= 0:
        return crc1
    p = _SHIFT_OPS.get(len2)
    if p is None:
        p, k, n = 1 << 31, 3, len2  # x^0; len2 bytes = len2 * 2^3 bits
        while n:
            if n & 1:
                p = _multmodp(_X2N[k & 31], p)
            n >>= 1
            k += 1
        if len(_SHIFT_OPS) >= 4096:
            _SHIFT_OPS.clear()
        _SHIFT_OPS[len2] = p
    return _multmodp(p, crc1) ^ crc2
