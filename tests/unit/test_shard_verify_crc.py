"""The fast paths of verification, their CRC32: an optional library (isal, zlib-ng) is used only
when it agrees with zlib, HSX_CRC32 forces the stdlib, every backend catches every flipped record
byte in chunked reads, crc32_combine's shift cache. The other fast paths: test_shard_verify_fast.py
(one process) and test_shard_verify_workers.py (threads and forked workers).
"""

from __future__ import annotations

import os
import sys
import threading
import types
import zlib

import pytest
from shard_helpers import expect, flip, make_run

import hsx.cores
import hsx.crc
import hsx.verify.check
import hsx.verify.full
import hsx.verify.pool
import hsx.verify.quick
import hsx.verify.quick_split
import hsx.ziprecords
from hsx.crc import crc32_combine, use_crc_backend
from hsx.errors import ShardBad
from hsx.verify.check import check_shard


@pytest.fixture(autouse=True)
def _stdlib_crc_after():
    yield
    use_crc_backend("auto")


def _fake_lib(monkeypatch, name: str, crc32, combine=None) -> None:
    """Install a fake `isal.isal_zlib` / `zlib_ng.zlib_ng` module for _crc_backend to find."""
    pkg, mod = name.split(".")
    lib = types.ModuleType(name)
    lib.crc32 = crc32
    if combine is not None:
        lib.crc32_combine = combine
    monkeypatch.setitem(sys.modules, pkg, types.ModuleType(pkg))
    monkeypatch.setitem(sys.modules, name, lib)


def _counting_crc(calls: list[int]):
    def crc32(data, value=0):
        calls.append(len(data))
        return zlib.crc32(data, value)

    return crc32


def test_a_crc_library_that_agrees_with_zlib_is_used_for_full(tmp_path, monkeypatch):
    calls: list[int] = []
    _fake_lib(monkeypatch, "zlib_ng.zlib_ng", _counting_crc(calls))
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)  # not installed
    assert use_crc_backend("auto") == "zlib-ng"
    _, (entry,) = make_run(tmp_path, n=1, length=7)
    path = tmp_path / entry.path
    calls.clear()
    check_shard(str(path), expect(), "full", entry)
    assert calls, "full did not use the selected CRC32"
    flip(path, path.stat().st_size // 2)
    with pytest.raises(ShardBad):
        check_shard(str(path), expect(), "full", entry)


@pytest.mark.parametrize(
    "crc32, combine",
    [
        (lambda data, value=0: zlib.crc32(data, value) ^ 1, None),  # wrong values
        (lambda data, value=0: zlib.crc32(data), None),  # ignores the start value
        (lambda data, value=0: zlib.crc32(bytes(data), value), lambda a, b, n: a ^ b),  # wrong combine
        (lambda data, value=0: 1 / 0, None),  # raises
    ],
)
def test_a_crc_library_that_disagrees_with_zlib_is_never_used(monkeypatch, crc32, combine):
    _fake_lib(monkeypatch, "isal.isal_zlib", crc32, combine)
    monkeypatch.setitem(sys.modules, "zlib_ng.zlib_ng", None)
    assert use_crc_backend("auto") == "zlib"
    assert hsx.crc._crc32 is zlib.crc32


def test_hsx_crc32_env_forces_the_stdlib(monkeypatch):
    _fake_lib(monkeypatch, "isal.isal_zlib", zlib.crc32)
    monkeypatch.setenv("HSX_CRC32", "zlib")
    assert hsx.crc._crc_backend()[0] == "zlib"
    monkeypatch.setenv("HSX_CRC32", "isal")
    assert hsx.crc._crc_backend()[0] == "isal"


@pytest.mark.parametrize("backend", ["zlib", "isal", "zlib-ng"])
def test_real_backends_catch_every_record_flip_in_chunked_reads(tmp_path, monkeypatch, backend):
    if use_crc_backend(backend) != backend:
        pytest.skip(f"{backend} is not installed here")
    _, (entry,) = make_run(tmp_path, n=1, length=9)
    path = tmp_path / entry.path
    monkeypatch.setattr(hsx.ziprecords, "SMALL_FILE", 0)  # the pread + combine path, chunk edges inside records
    monkeypatch.setattr(hsx.crc, "_DIRECT_CRC_MAX", 0)
    monkeypatch.setattr(hsx.crc, "_CHUNK", 101)
    monkeypatch.setattr(hsx.crc, "_tls", threading.local())
    check_shard(str(path), expect(), "full", entry)
    data = path.read_bytes()
    with open(path, "r+b") as f:
        for off in range(0, len(data), 37):
            os.pwrite(f.fileno(), bytes([data[off] ^ 0x04]), off)
            with pytest.raises(ShardBad):
                check_shard(str(path), expect(), "full", entry)
            os.pwrite(f.fileno(), data[off : off + 1], off)


def test_crc32_combine_repeats_a_length_from_its_cache():
    a, b, c = os.urandom(100), os.urandom(4099), os.urandom(4099)
    first = crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b))
    assert 4099 in hsx.crc._SHIFT_OPS
    assert crc32_combine(first, zlib.crc32(c), len(c)) == zlib.crc32(a + b + c)
