"""One shard checked: its structure (`quick`), its CRCs (`full`), and a torch-based `deep` hook.

check_shard is the verdict on one file: ShardBad(reason) for bad data, ShardIOError when the
file could not be read. It never follows a symlink, never blocks on a FIFO, and never executes
the shard's pickle. The structure check remembers the layout of each small shard that passes
(ShardLayout): a later file of the same length whose structural bytes repeat it exactly passes
without being parsed again.
"""

from __future__ import annotations

import errno
import operator
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import ziprecords
from ..crc import crc_check
from ..errors import ShardBad, ShardIOError
from ..index import IndexEntry, checksum_string
from ..layout import (
    DTYPES,
    HIDDEN_DTYPES,
    INPUT_IDS_DTYPE,
    KEY_AUX,
    KEY_HIDDEN,
    KEY_INPUT_IDS,
    KEY_LOSS_MASK,
    LOSS_MASK_DTYPES,
    MANIFEST_NAME,
    SHARD_KEYS,
)
from ..manifest import ManifestError, manifest_fingerprint
from ..torchpickle import MAX_PICKLE, TensorMeta, read_tensor_pickle
from ..ziprecords import ShardReader, ZipRecord, read_zip_records

_U32 = struct.Struct("<I")
# How a shard is opened: never through a symlink (O_NOFOLLOW), never blocking on a FIFO (O_NONBLOCK).
OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)

LEVELS = ("quick", "full", "deep")


@dataclass
class Expect:
    """What run.json says every shard must hold."""

    hidden_size: int
    num_aux: int
    dtype: str
    vocab_size: int | None = None
    fingerprint: str | None = None  # run.json's (manifest_fingerprint): index entries must carry it

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], source: str = MANIFEST_NAME) -> Expect:
        try:
            hidden = manifest["hidden_size"]
            layer_ids = manifest["layer_ids"]
            dtype = manifest["dtype"]
        except KeyError as e:
            raise ManifestError(f"{source}: run manifest lacks {e.args[0]!r}") from None
        vocab = manifest.get("vocab_size")
        if not _is_int(hidden) or hidden <= 0 or not isinstance(layer_ids, list) or not layer_ids:
            raise ManifestError(f"{source}: hidden_size/layer_ids invalid")
        if dtype not in HIDDEN_DTYPES:
            raise ManifestError(f"{source}: dtype {dtype!r} is not one of {', '.join(HIDDEN_DTYPES)}")
        return cls(hidden, len(layer_ids), dtype, vocab if _is_int(vocab) else None, manifest_fingerprint(manifest))


@dataclass
class ShardInfo:
    """What the structure check learnt about a shard (used by the full and deep levels)."""

    size: int
    num_tokens: int
    records: list[ZipRecord]
    cd_offset: int
    tensors: dict[str, TensorMeta]
    data: bytes | None = None  # the whole file when it is small enough to have been read at once

    def crc_of(self, rec: ZipRecord) -> int:
        """The record's CRC32 as this file's central directory states it.

        Records may be shared with a byte-identical layout (see ShardLayout), so for files held in
        memory the CRC is read from this file's own bytes, never from the shared record.
        """
        if self.data is not None:
            return _U32.unpack_from(self.data, rec.crc_at)[0]
        return rec.crc


def inspect_shard(fd: int, expect: Expect, size: int | None = None, data: bytes | None = None) -> ShardInfo:
    """The `quick` level on an open file: zip structure + pickled metadata, nothing executed.

    `data`, when given, is the whole file as already read from `fd` (len(data) == size).
    """
    if size is None:
        size = os.fstat(fd).st_size
    if size == 0:
        raise ShardBad("empty file")
    reader = ShardReader(fd, size, data)
    if reader.whole is None:
        return _inspect(reader, expect)
    layout = _match_layout(reader.whole, expect)
    if layout is not None:
        return layout.info_for(reader.whole)
    info = _inspect(reader, expect)
    key = (size, expect.hidden_size, expect.num_aux, expect.dtype)
    layouts = _LAYOUTS.setdefault(key, [])
    if len(layouts) < 4:
        if len(_LAYOUTS) >= 1024:
            _LAYOUTS.clear()
            layouts = _LAYOUTS.setdefault(key, [])
        layouts.append(ShardLayout(info))
    return info


def _match_layout(data: bytes, expect: Expect) -> ShardLayout | None:
    """The remembered layout whose structural bytes `data` repeats exactly, if any."""
    for layout in _LAYOUTS.get((len(data), expect.hidden_size, expect.num_aux, expect.dtype), ()):
        if layout.get(data) == layout.fingerprint:
            return layout
    return None


def _varies(name: str) -> bool:
    """Records whose bytes differ between shards of one layout: tensor storages, the save's id."""
    return "/data/" in name or name.endswith("/.data/serialization_id")


class ShardLayout:
    """Every byte of a small shard except those that legitimately vary between shards.

    Shards of one run that have the same length are byte-identical outside their tensor data,
    the per-save serialization id and the CRCs of those (torch.save writes the same headers,
    names, padding and pickle). A file whose other bytes all equal those of a file that passed
    is, by determinism, a file that passes with the same records and tensors: comparing the
    bytes replaces re-parsing them. Compared: everything from offset 0 to the end of the file
    except, for each varying record, its data up to the next local header (the data and its
    data descriptor) and its CRC field in the central directory (`full` reads those from each
    file: ShardInfo.crc_of). So every byte `_inspect` reads - end records, central directory,
    local headers, data.pkl, byteorder - is compared.
    """

    __slots__ = ("get", "fingerprint", "info")

    def __init__(self, info: ShardInfo):
        if info.data is None:
            raise ValueError("ShardLayout needs the whole file's bytes (ShardInfo.data)")
        recs = sorted(info.records, key=lambda r: r.header_offset)
        skip = []
        for i, r in enumerate(recs):
            if _varies(r.name):
                skip.append(
                    (r.data_offset, recs[i + 1].header_offset if i + 1 < len(recs) else info.cd_offset)
                )
                skip.append((r.crc_at, r.crc_at + 4))
        regions, cursor = [], 0
        for a, b in sorted(skip):
            if a > cursor:
                regions.append(slice(cursor, a))
            cursor = max(cursor, b)
        regions.append(slice(cursor, None))  # to the end of the data given: another length never matches
        # One C call slices every region: (data[r0], data[r1], ...) compared as a tuple.
        self.get = operator.itemgetter(*regions, slice(0, 0))
        self.info = info
        self.fingerprint = self.get(info.data)

    def info_for(self, data: bytes) -> ShardInfo:
        base = self.info
        return ShardInfo(base.size, base.num_tokens, base.records, base.cd_offset, base.tensors, data)


_LAYOUTS: dict[tuple[int, int, int, str], list[ShardLayout]] = {}


def known_layouts(size: int, expect: Expect) -> list[ShardLayout]:
    """The layouts learnt for shards of `size` bytes under `expect` (first learnt first)."""
    return _LAYOUTS.get((size, expect.hidden_size, expect.num_aux, expect.dtype)) or []


def _inspect(reader: ShardReader, expect: Expect) -> ShardInfo:
    """The structure check proper (inspect_shard adds the layout memo in front of it)."""
    size = reader.size
    records, cd_offset = read_zip_records(reader)
    by_name = {r.name: r for r in records}
    prefix = records[0].name.split("/", 1)[0] if "/" in records[0].name else ""
    if not prefix or any(not r.name.startswith(prefix + "/") for r in records):
        raise ShardBad("records do not share one archive folder (not a torch.save file)")
    pkl = by_name.get(f"{prefix}/data.pkl")
    if pkl is None:
        raise ShardBad("no data.pkl record")
    ziprecords.check_torch_version(reader, by_name, prefix)
    # Records are read only up to the size they can have: a size the directory declares is data.
    order = by_name.get(f"{prefix}/byteorder")
    if order is not None and (order.size != 6 or reader.read(order.data_offset, 6) != b"little"):
        raise ShardBad("byteorder record is not 'little'")
    if pkl.size > MAX_PICKLE:
        raise ShardBad(f"pickle too large ({pkl.size} bytes)")
    tensors = _parse_pickle_cached(reader.read(pkl.data_offset, pkl.size))
    missing = [k for k in SHARD_KEYS if k not in tensors]
    extra = sorted(k for k in tensors if k not in SHARD_KEYS)
    if missing or extra:
        parts = ([f"missing keys {missing}"] if missing else []) + (
            [f"unexpected keys {extra}"] if extra else []
        )
        raise ShardBad(", ".join(parts))
    for key, t in tensors.items():
        _check_tensor_bounds(key, t, by_name, prefix)
    length = tensors[KEY_INPUT_IDS].shape[0] if len(tensors[KEY_INPUT_IDS].shape) == 1 else -1
    h, k = expect.hidden_size, expect.num_aux
    want = {
        KEY_INPUT_IDS: (length,),
        KEY_LOSS_MASK: (length,),
        KEY_HIDDEN: (1, length, h),
        KEY_AUX: (1, length, k * h),
    }
    for key in SHARD_KEYS:
        if tensors[key].shape != want[key] or length < 1:
            raise ShardBad(
                f"{key} has shape {list(tensors[key].shape)}, expected {list(want[key])} "
                f"(L={length}, H={h}, k={k} from run.json)"
            )
    dtypes = {KEY_INPUT_IDS: (INPUT_IDS_DTYPE,), KEY_LOSS_MASK: LOSS_MASK_DTYPES}
    for key in SHARD_KEYS:
        allowed = dtypes.get(key, (expect.dtype,))
        if tensors[key].storage.dtype not in allowed:
            raise ShardBad(f"{key} is {tensors[key].storage.dtype}, expected {' or '.join(allowed)}")
    return ShardInfo(size, length, records, cd_offset, tensors, reader.whole)


_PICKLE_CACHE: dict[bytes, dict[str, TensorMeta]] = {}


def _parse_pickle_cached(data: bytes) -> dict[str, TensorMeta]:
    """read_tensor_pickle memoised on the exact bytes (a pure function of them).

    Shards of one run differ in their pickle only by L, so most files repeat an earlier one.
    Only successful parses are kept; the results are never mutated.
    """
    hit = _PICKLE_CACHE.get(data)
    if hit is None:
        hit = read_tensor_pickle(data)
        if len(_PICKLE_CACHE) >= 4096:
            _PICKLE_CACHE.clear()
        _PICKLE_CACHE[data] = hit
    return hit


def _check_tensor_bounds(key: str, t: TensorMeta, by_name: dict[str, ZipRecord], prefix: str) -> None:
    s = t.storage
    rec = by_name.get(f"{prefix}/data/{s.key}")
    if rec is None:
        raise ShardBad(f"{key}: storage record data/{s.key} missing")
    itemsize = DTYPES[s.dtype][1]
    if rec.size != s.numel * itemsize:
        raise ShardBad(
            f"{key}: storage data/{s.key} holds {rec.size} bytes, pickle says {s.numel} x {itemsize}"
        )
    if s.location != "cpu":
        raise ShardBad(f"{key}: stored on {s.location!r}, not cpu (loading would need that device)")
    if t.offset < 0 or any(n < 0 for n in t.shape) or any(st < 0 for st in t.stride):
        raise ShardBad(f"{key}: negative offset, size or stride")
    if all(n > 0 for n in t.shape):
        last = t.offset + sum((n - 1) * st for n, st in zip(t.shape, t.stride, strict=True))
        if last >= s.numel:
            raise ShardBad(f"{key}: view reaches element {last} of a {s.numel}-element storage")
    _check_contiguous(key, t)


def _check_contiguous(key: str, t: TensorMeta) -> None:
    """A tensor as our writer saves it: contiguous, alone in a storage of exactly its elements.

    Anything else is not a shard of ours, however well it loads: strides of 0 (torch.save of an
    expanded tensor) let a 2 KB file declare 4e9 tokens, which `deep` would then walk one by one.
    A dim of size 1 may have any stride (torch calls such a tensor contiguous, and a clone keeps
    it). Checked when the structure is parsed, so also when a layout is learnt: a file that
    later passes by repeating a learnt layout repeats its data.pkl, hence these strides.
    """
    shape, stride = t.shape, t.stride
    numel = 1
    for n in shape:
        numel *= n
    if not numel:  # no elements: nothing to walk (and no shard has such a tensor: the shape check)
        return
    want, acc = [], 1
    for n in reversed(shape):
        want.append(acc)
        acc *= n
    want.reverse()
    if any(n != 1 and st != w for n, st, w in zip(shape, stride, want, strict=True)):
        raise ShardBad(
            f"{key}: strides {list(stride)} for shape {list(shape)} are not contiguous "
            f"(expected {want}): not a tensor our writer saves"
        )
    if t.offset != 0:
        raise ShardBad(f"{key}: starts at storage offset {t.offset}, not 0: not a tensor our writer saves")
    if t.storage.numel != numel:
        raise ShardBad(
            f"{key}: storage data/{t.storage.key} holds {t.storage.numel} elements for a tensor of "
            f"{numel}: not a tensor our writer saves"
        )


def check_shard(
    path: str,
    expect: Expect,
    level: str = "quick",
    entry: IndexEntry | None = None,
    deep_check: Callable[[str, Expect, ShardInfo], str | None] | None = None,
) -> tuple[int, int]:
    """Verify one shard at `level`; returns (bytes read, num_tokens).

    Raises ShardBad(reason) for bad data and ShardIOError when the file cannot be read.
    `deep_check` (torch-based, outside this file) returns a reason or None.
    """
    try:
        fd = os.open(path, OPEN_FLAGS)
    except FileNotFoundError:
        raise ShardBad("file disappeared during verification") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ShardBad("a symlink, not a regular file") from None
        raise ShardIOError(f"{path}: cannot open: {e.strerror}") from None
    except ValueError:  # a NUL byte or a lone surrogate: no file has that name
        raise ShardBad("the path cannot name a file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ShardBad("not a regular file")
        size = st.st_size
        try:
            data = None
            if 0 < size <= ziprecords.SMALL_FILE:  # one read serves the whole structure check
                data = os.pread(fd, size, 0)
                if len(data) != size:
                    raise ShardBad(f"file changed while reading ({len(data)} of {size} bytes)")
                if level == "quick":  # the hot path: a known layout needs no ShardInfo
                    layout = _match_layout(data, expect)
                    if layout is not None:
                        _check_entry(entry, size, layout.info.num_tokens)
                        return size, layout.info.num_tokens
            info = inspect_shard(fd, expect, size, data)
            read = info.size if info.size <= ziprecords.SMALL_FILE else 0
            _check_entry(entry, info.size, info.num_tokens)
            if level in ("full", "deep"):
                whole = crc_check(fd, info)
                read = info.size
                if entry is not None and checksum_string(whole) != entry.checksum:
                    raise ShardBad(
                        f"file checksum {checksum_string(whole)} differs from the index ({entry.checksum})"
                    )
            if level == "deep" and deep_check is not None:
                reason = deep_check(path, expect, info)
                if reason:
                    raise ShardBad(reason)
        except OSError as e:
            raise ShardIOError(f"{path}: read error: {e.strerror or e}") from None
        return read, info.num_tokens
    finally:
        os.close(fd)


def _check_entry(entry: IndexEntry | None, size: int, num_tokens: int) -> None:
    if entry is not None:
        if size != entry.size:
            raise ShardBad(f"size {size} differs from the index ({entry.size})")
        if num_tokens != entry.num_tokens:
            raise ShardBad(f"{num_tokens} tokens, the index says {entry.num_tokens}")


def check_batch(
    output_dir: str,
    jobs: list[tuple[str, IndexEntry | None]],
    level: str,
    expect: Expect,
    deep_check: Callable[[str, Expect, ShardInfo], str | None] | None,
) -> tuple[int, int, int, list[tuple[str, str, str]]]:
    """Worker body: (files checked, files ok, bytes read, [(relpath, 'bad'|'error', reason)])."""
    ok = nbytes = 0
    problems = []
    root = output_dir.rstrip("/") + "/" if output_dir else ""
    for rel, entry in jobs:
        try:
            nbytes += check_shard(root + rel, expect, level, entry, deep_check)[0]
            ok += 1
        except ShardBad as e:
            problems.append((rel, "bad", str(e)))
        except ShardIOError as e:
            problems.append((rel, "error", str(e)))
    return len(jobs), ok, nbytes, problems


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
