"""The shard format: one stdlib-only source of truth, shipped to hosts through module_utils.

Everything that both the extraction package and the Ansible module `shard_verify` need lives
here: the layout of an output directory, shard and temp naming, the index log, run.json
reading, and the `quick` / `full` verifiers. It imports nothing outside the standard library,
because right after a crash the host may not have torch or the extraction package installed.

Output layout::

    OUTPUT/run.json                      run manifest (refuse to mix runs)
    OUTPUT/index.jsonl                   append-only log of completed samples
    OUTPUT/shards/<bucket>/<id>.pt       one torch.save dict per sample
    OUTPUT/quarantine/<bucket>/<id>.pt   shards that failed verification, + .reason.json

Why an append-only JSONL index and not SQLite: one `write()` of short lines with O_APPEND
after the shards are already fsynced and renamed (one line a shard, one write a batch of them)
is the whole commit protocol; a crash can only tear the last lines, which their per-line CRC32
detects and `load_index` skips. It is readable
with the standard library, grep and jq on any host, survives copying between filesystems
(NFS, overlay) where SQLite locking is unreliable, and is only ever a hint: verification
reconciles it against the files on disk, so a lost tail costs a re-index, never bad data.
Later lines win, so a quarantine appends a tombstone and the sample counts as not done.
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import itertools
import json
import math
import operator
import os
import re
import stat
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT_VERSION = 1

# --- layout ---------------------------------------------------------------------------------
MANIFEST_NAME = "run.json"
INDEX_NAME = "index.jsonl"
SHARDS_DIR = "shards"
QUARANTINE_DIR = "quarantine"
SHARD_SUFFIX = ".pt"
TEMP_PREFIX = "."
TEMP_SUFFIX = ".tmp"
REASON_SUFFIX = ".reason.json"
BUCKET_HEX_CHARS = 2  # 256 buckets: ~146 files each at 37k samples, ~4k at 1M

# --- tensors in a shard ---------------------------------------------------------------------
KEY_INPUT_IDS = "input_ids"
KEY_LOSS_MASK = "loss_mask"
KEY_HIDDEN = "hidden_state"
KEY_AUX = "aux_hidden_state"
SHARD_KEYS = (KEY_INPUT_IDS, KEY_LOSS_MASK, KEY_HIDDEN, KEY_AUX)

# dtype name (as torch spells it after "torch.") -> (legacy storage class torch.save pickles, itemsize)
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("DoubleStorage", 8),
    "float32": ("FloatStorage", 4),
    "float16": ("HalfStorage", 2),
    "bfloat16": ("BFloat16Storage", 2),
    "int64": ("LongStorage", 8),
    "int32": ("IntStorage", 4),
    "int16": ("ShortStorage", 2),
    "int8": ("CharStorage", 1),
    "uint8": ("ByteStorage", 1),
    "bool": ("BoolStorage", 1),
}
STORAGE_DTYPES = {storage: name for name, (storage, _) in DTYPES.items()}
HIDDEN_DTYPES = ("bfloat16", "float16", "float32")
INPUT_IDS_DTYPE = "int64"
LOSS_MASK_DTYPES = ("int64", "int32", "uint8", "bool")

_SAFE_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,119}$")
_UNSAFE_CHAR = re.compile(r"[^A-Za-z0-9._-]")


# --- naming ---------------------------------------------------------------------------------
def safe_name(sample_id: str) -> str:
    """A file-name stem for a sample id, injective: safe ids map to themselves, others get a hash.

    Safe = [A-Za-z0-9._-], not starting with '.', at most 120 chars. Anything else becomes a
    sanitised prefix + '~' + 16 hex of its SHA-1; '~' never occurs in a safe id, so two ids
    cannot share a name.
    """
    if not isinstance(sample_id, str) or not sample_id:
        raise ValueError(f"sample id must be a non-empty string, got {sample_id!r}")
    if _SAFE_ID.match(sample_id):
        return sample_id
    digest = hashlib.sha1(sample_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    prefix = _UNSAFE_CHAR.sub("_", sample_id)[:64].lstrip(".")
    return f"{prefix}~{digest}"


def bucket_of(sample_id: str) -> str:
    """Subfolder for a sample: a SHA-1 prefix of its id, so folders stay small and balanced."""
    return hashlib.sha1(sample_id.encode("utf-8", "surrogatepass")).hexdigest()[:BUCKET_HEX_CHARS]


def shard_relpath(sample_id: str) -> str:
    """Path of a sample's shard relative to the output root: `shards/<bucket>/<safe id>.pt`."""
    return f"{SHARDS_DIR}/{bucket_of(sample_id)}/{safe_name(sample_id)}{SHARD_SUFFIX}"


_TEMP_TAG = os.urandom(4).hex()  # with the pid and a counter: unique without a getrandom per shard
_TEMP_COUNTER = itertools.count()


def temp_name(final_name: str) -> str:
    """A temp name next to `final_name`: hidden, unique, and never ending in `.pt`."""
    return f"{TEMP_PREFIX}{final_name}.{os.getpid()}.{_TEMP_TAG}{next(_TEMP_COUNTER):x}{TEMP_SUFFIX}"


def is_temp_name(name: str) -> bool:
    return name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX)


def is_shard_name(name: str) -> bool:
    return name.endswith(SHARD_SUFFIX) and not name.startswith(TEMP_PREFIX)


# --- index ----------------------------------------------------------------------------------
@dataclass(slots=True)
class IndexEntry:
    """One completed sample: where its shard is (relative to the output root) and what it holds."""

    sample_id: str
    path: str
    size: int
    checksum: str  # "crc32:xxxxxxxx" of the whole file
    num_tokens: int


def checksum_string(crc: int) -> str:
    return f"crc32:{crc & 0xFFFFFFFF:08x}"


def encode_index_line(record: dict[str, Any]) -> bytes:
    """`<compact json>\\t<crc32 of the json>\\n`: a torn or damaged line fails its own CRC."""
    body = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    crc = zlib.crc32(body.encode("ascii")) & 0xFFFFFFFF
    return f"{body}\t{crc:08x}\n".encode("ascii")


def decode_index_line(line: bytes) -> dict[str, Any] | None:
    """The record of one index line, or None when the line is torn or damaged."""
    if not line.endswith(b"\n"):
        return None
    body, sep, crc = line[:-1].rpartition(b"\t")
    if not sep or len(crc) != 8:
        return None
    try:
        if zlib.crc32(body) & 0xFFFFFFFF != int(crc, 16):
            return None
        record = json.loads(body)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _line_body(line: bytes) -> bytes | None:
    """The JSON body of an index line whose CRC checks out (decode_index_line's test), else None."""
    body, sep, crc = line[:-1].rpartition(b"\t")
    if not (line.endswith(b"\n") and sep and len(crc) == 8):
        return None
    try:
        return body if zlib.crc32(body) & 0xFFFFFFFF == int(crc, 16) else None
    except ValueError:
        return None


def _decode_index_lines(lines: list[bytes]) -> list[dict[str, Any] | None]:
    """decode_index_line for many lines: CRCs per line, then one JSON parse for all of them.

    Lines exactly as encode_index_line writes them (body, tab, 8 lowercase hex, newline) are
    checked with one comparison; any other line goes through decode_index_line's own test.
    """
    crc32 = zlib.crc32
    bodies: list[bytes | None] = [line[:-10] for line in lines]
    for i, (line, body) in enumerate(zip(lines, bodies, strict=True)):
        if line[-10:] != b"\t%08x\n" % crc32(body):
            bodies[i] = _line_body(line)
    good = [b for b in bodies if b is not None]
    try:
        parsed = iter(json.loads(b"[" + b",".join(good) + b"]"))
    except ValueError:  # a line with a valid CRC but bad JSON (hand-edited): fall back line by line
        return [decode_index_line(line) for line in lines]
    out: list[dict[str, Any] | None] = []
    for b in bodies:
        record = next(parsed) if b is not None else None
        out.append(record if isinstance(record, dict) else None)
    return out


@dataclass
class IndexState:
    """An index read back: live entries plus how many lines were unreadable."""

    entries: dict[str, IndexEntry] = field(default_factory=dict)
    bad_lines: int = 0
    torn_tail: bool = False


def read_index(output_dir: str) -> IndexState:
    """Replay index.jsonl: later lines win; tombstones drop a sample; damaged lines are skipped.

    A missing index is an empty one (a run that has not finished a sample yet).
    """
    return _replay_index(_read_index_lines(output_dir))


def _read_index_lines(output_dir: str) -> list[bytes]:
    """index.jsonl's lines as stored (none when it does not exist)."""
    try:
        with open(os.path.join(output_dir, INDEX_NAME), "rb") as f:
            return f.readlines()
    except FileNotFoundError:
        return []


def _replay_index(lines: list[bytes]) -> IndexState:
    """read_index on lines already read."""
    state = IndexState()
    for n, record in enumerate(_decode_index_lines(lines)):
        if record is None:
            if n == len(lines) - 1:
                state.torn_tail = True
            else:
                state.bad_lines += 1
            continue
        sample_id = record.get("id")
        if not isinstance(sample_id, str):
            state.bad_lines += 1
            continue
        if record.get("removed"):
            state.entries.pop(sample_id, None)
            continue
        try:
            state.entries[sample_id] = IndexEntry(
                sample_id,
                str(record["path"]),
                int(record["size"]),
                str(record["checksum"]),
                int(record["num_tokens"]),
            )
        except (KeyError, TypeError, ValueError):
            state.bad_lines += 1
    return state


def load_index(output_dir: str) -> dict[str, IndexEntry]:
    """sample_id -> IndexEntry of every completed (not quarantined) sample."""
    return read_index(output_dir).entries


def index_record(entry: IndexEntry) -> dict[str, Any]:
    return {
        "id": entry.sample_id,
        "path": entry.path,
        "size": entry.size,
        "checksum": entry.checksum,
        "num_tokens": entry.num_tokens,
    }


def tombstone_record(sample_id: str, reason: str) -> dict[str, Any]:
    return {"id": sample_id, "removed": True, "reason": reason, "at": round(time.time(), 3)}


def append_index(output_dir: str, records: Iterable[dict[str, Any]], fsync: bool = True) -> None:
    """Append records with one O_APPEND write, then fsync: the only way the index changes."""
    if not (data := b"".join(encode_index_line(r) for r in records)):
        return
    fd = open_index_for_append(output_dir)
    try:
        write_index_bytes(fd, data, fsync)
    finally:
        os.close(fd)


def open_index_for_append(output_dir: str) -> int:
    """The index opened for appends (created if absent); a long-lived writer keeps it open."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    return os.open(os.path.join(output_dir, INDEX_NAME), flags, 0o644)


def write_index_bytes(fd: int, data: bytes, fsync: bool = True) -> None:
    """Encoded index lines onto an index fd opened by open_index_for_append (O_APPEND: each
    write lands at the end), then fsync. All or nothing: when a write or the fsync fails part-way
    (a full disk after the first of several writes), the index is cut back to where it ended,
    so no whole line stays behind for a shard its writer then takes back - unless someone else
    (`hsx verify --quarantine` beside a run) appended meanwhile: their lines are left alone."""
    start = os.lseek(fd, 0, os.SEEK_END)
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    except BaseException:
        try:
            if os.fstat(fd).st_size == start + len(data) - len(view):
                os.ftruncate(fd, start)
                if fsync:
                    os.fsync(fd)
        except OSError:
            pass  # the error that counts is the caller's; a torn last line fails its own CRC
        raise


# --- run.json -------------------------------------------------------------------------------
class ManifestError(Exception):
    """run.json is missing or unreadable: the directory is not a run (an I/O or usage error)."""


def read_manifest_dict(output_dir: str) -> dict[str, Any]:
    path = os.path.join(output_dir, MANIFEST_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ManifestError(f"{output_dir}: not an extraction run (no {MANIFEST_NAME})") from None
    except PermissionError as e:
        raise ManifestError(f"{path}: cannot read: {e.strerror}") from None
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path}: unreadable run manifest: {e}") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{path}: run manifest is not a JSON object")
    return data


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Temp in the same directory -> write -> fsync -> rename -> fsync the directory."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, temp_name(name))
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quiet(tmp)
        raise
    fsync_dir(directory or ".")


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# --- orphan temps ---------------------------------------------------------------------------
def find_orphan_temps(output_dir: str) -> list[str]:
    """Writer temp files (relative paths) in the output root and every shard bucket."""
    found = []
    for rel in ("", SHARDS_DIR):
        try:
            with os.scandir(os.path.join(output_dir, rel) if rel else output_dir) as it:
                entries = list(it)
        except FileNotFoundError:
            continue
        for e in entries:
            if is_temp_name(e.name) and e.is_file(follow_symlinks=False):
                found.append(f"{rel}/{e.name}" if rel else e.name)
            elif rel == SHARDS_DIR and e.is_dir(follow_symlinks=False):
                with os.scandir(e.path) as bucket:
                    for b in bucket:
                        if is_temp_name(b.name) and b.is_file(follow_symlinks=False):
                            found.append(f"{SHARDS_DIR}/{e.name}/{b.name}")
    return sorted(found)


def remove_orphan_temps(output_dir: str) -> list[str]:
    """Delete the temp files find_orphan_temps lists; returns the ones removed."""
    removed = []
    for rel in find_orphan_temps(output_dir):
        try:
            os.unlink(os.path.join(output_dir, rel))
        except FileNotFoundError:
            continue
        removed.append(rel)
    return removed


# --- verification: zip structure -------------------------------------------------------------
class ShardBad(Exception):
    """The shard is damaged or not a shard of this run; the message is the reason."""


_EOCD = struct.Struct("<IHHHHIIH")  # sig, disk, cd disk, n here, n total, cd size, cd offset, comment len
_Z64_LOCATOR = struct.Struct("<IIQI")  # sig, disk, z64 eocd offset, disks
_Z64_EOCD = struct.Struct(
    "<IQHHIIQQQQ"
)  # sig, size, made, needed, disk, cd disk, n here, n, cd size, cd offset
_CDIR = struct.Struct("<IHHHHHHIIIHHHHHII")
# The central-directory fields we use: sig, flags, method, crc, csize, usize, nlen, elen, clen, offset.
_CDIR_FIELDS = struct.Struct("<I4xHH4xIIIHHH8xI")
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_SIG_EOCD, _SIG_Z64_LOC, _SIG_Z64_EOCD = 0x06054B50, 0x07064B50, 0x06064B50
_SIG_CDIR, _SIG_LOCAL = 0x02014B50, 0x04034B50
_MAX_RECORDS = 4096
_MAX_PICKLE = 1 << 20  # a shard's data.pkl is ~400 bytes
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_SMALL_FILE = 1 << 20  # read whole files up to this size in one go


@dataclass(slots=True)
class ZipRecord:
    name: str
    header_offset: int
    data_offset: int
    size: int
    crc: int
    raw_name: bytes = b""
    crc_at: int = -1  # file offset of this record's CRC field in the central directory


class _Reader:
    """Positional reads on an open file; small files are read once and served from memory."""

    def __init__(self, fd: int, size: int, whole: bytes | None = None):
        self.fd, self.size = fd, size
        if whole is None and size <= _SMALL_FILE:
            whole = os.pread(fd, size, 0)
        self.whole = whole
        if self.whole is not None and len(self.whole) != size:
            raise ShardBad(f"file changed while reading ({len(self.whole)} of {size} bytes)")

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ShardBad(f"record at {offset}+{length} lies outside the file ({self.size} bytes)")
        if self.whole is not None:
            return self.whole[offset : offset + length]
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise ShardBad(f"short read at {offset}: file changed while reading")
        return data


def _zip64_extra(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + length]
        if len(body) != length:
            raise ShardBad("central directory extra field runs past its entry")
        if tag == 0x0001:
            vals = list(struct.unpack_from(f"<{length // 8}Q", body)) if length >= 8 else []
            if usize == 0xFFFFFFFF:
                usize = vals.pop(0) if vals else -1
            if csize == 0xFFFFFFFF:
                csize = vals.pop(0) if vals else -1
            if offset == 0xFFFFFFFF:
                offset = vals.pop(0) if vals else -1
        pos += 4 + length
    if -1 in (usize, csize, offset) or 0xFFFFFFFF in (usize, csize, offset):
        raise ShardBad("zip64 sizes missing from the central directory")
    return usize, csize, offset


def read_zip_records(reader: _Reader) -> tuple[list[ZipRecord], int]:
    """The records of a stored zip, each proven to lie inside the file; also the CD's offset."""
    size = reader.size
    if size < _EOCD.size:
        raise ShardBad(f"too short to be a zip ({size} bytes)")
    # torch.save writes no archive comment, so the end record is the file's last 22 bytes.
    eocd_at = size - _EOCD.size
    sig, disk, cd_disk, n_here, n_total, cd_size, cd_offset, comment_len = _EOCD.unpack(
        reader.read(eocd_at, _EOCD.size)
    )
    if sig != _SIG_EOCD or comment_len != 0:
        raise ShardBad("zip end-of-central-directory record missing (truncated or not a torch.save file)")
    if disk != 0 or cd_disk != 0 or n_here != n_total:
        raise ShardBad("multi-disk zip")
    cd_end = eocd_at
    if 0xFFFF in (n_here, n_total) or 0xFFFFFFFF in (cd_size, cd_offset) or eocd_at >= _Z64_LOCATOR.size:
        loc_at = eocd_at - _Z64_LOCATOR.size
        loc = _Z64_LOCATOR.unpack(reader.read(loc_at, _Z64_LOCATOR.size)) if loc_at >= 0 else None
        if loc is not None and loc[0] == _SIG_Z64_LOC:
            z64_at = loc[2]
            if z64_at + _Z64_EOCD.size != loc_at:
                raise ShardBad("zip64 end record is not where its locator says")
            z = _Z64_EOCD.unpack(reader.read(z64_at, _Z64_EOCD.size))
            if z[0] != _SIG_Z64_EOCD:
                raise ShardBad("zip64 end record signature damaged")
            n_total, cd_size, cd_offset = z[7], z[8], z[9]
            cd_end = z64_at
        elif 0xFFFF in (n_here, n_total) or 0xFFFFFFFF in (cd_size, cd_offset):
            raise ShardBad("zip64 end records missing")
    if cd_offset + cd_size != cd_end:
        raise ShardBad(f"central directory ({cd_offset}+{cd_size}) does not end at its end record ({cd_end})")
    if n_total < 1 or n_total > _MAX_RECORDS:
        raise ShardBad(f"implausible record count {n_total}")
    cd = reader.read(cd_offset, cd_size)
    records: list[ZipRecord] = []
    names: set[str] = set()
    pos = 0
    for _ in range(n_total):
        if pos + _CDIR.size > len(cd):
            raise ShardBad("central directory shorter than its record count")
        pos_entry = pos
        sig, flags, method, crc, csize, usize, nlen, elen, clen, offset = _CDIR_FIELDS.unpack_from(cd, pos)
        if sig != _SIG_CDIR:
            raise ShardBad(f"central directory entry {len(records)} has a damaged signature")
        start = pos + _CDIR.size
        raw_name = cd[start : start + nlen]
        pos = start + nlen + elen + clen
        if pos > len(cd):
            raise ShardBad("central directory entry runs past the directory")
        if method != 0 or flags & 0x1:
            raise ShardBad("compressed or encrypted record (torch.save stores records uncompressed)")
        if elen or 0xFFFFFFFF in (usize, csize, offset):
            usize, csize, offset = _zip64_extra(cd[start + nlen : start + nlen + elen], usize, csize, offset)
        if usize != csize:
            raise ShardBad("record sizes disagree")
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            raise ShardBad("record name is not UTF-8") from None
        if name in names:
            raise ShardBad(f"duplicate record {name!r}")
        names.add(name)
        records.append(ZipRecord(name, offset, -1, usize, crc, raw_name, cd_offset + pos_entry + 16))
    if pos != len(cd):
        raise ShardBad("central directory has trailing bytes")
    # Local headers: each where the directory says, named the same, its data before the next one.
    records.sort(key=lambda r: r.header_offset)
    for i, rec in enumerate(records):
        head = reader.read(rec.header_offset, _LOCAL.size + len(rec.raw_name))
        lf = _LOCAL.unpack_from(head)
        if lf[0] != _SIG_LOCAL:
            raise ShardBad(f"record {rec.name!r}: local header damaged")
        nlen, elen = lf[9], lf[10]
        if head[_LOCAL.size :] != rec.raw_name or nlen != len(rec.raw_name):
            raise ShardBad(f"record {rec.name!r}: local header names a different record")
        rec.data_offset = rec.header_offset + _LOCAL.size + nlen + elen
        limit = records[i + 1].header_offset if i + 1 < len(records) else cd_offset
        if rec.data_offset + rec.size > limit:
            raise ShardBad(f"record {rec.name!r} overlaps the next record or runs past the data")
    return records, cd_offset


# --- verification: the pickle, read without executing it ------------------------------------
@dataclass
class StorageRef:
    key: str
    dtype: str
    location: str
    numel: int


@dataclass
class TensorMeta:
    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class _Global:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


_REBUILD = "torch._utils._rebuild_tensor_v2"
_ORDERED_DICT = "collections.OrderedDict"
_ALLOWED_GLOBALS = {_REBUILD, _ORDERED_DICT} | {f"torch.{s}" for s in STORAGE_DTYPES}


def read_tensor_pickle(data: bytes) -> dict[str, TensorMeta]:
    """Interpret torch.save's data.pkl as data, never as code.

    Only the opcodes torch's writer emits are understood; GLOBAL may name only the tensor
    rebuild function, OrderedDict and the storage classes, and nothing is ever called:
    REDUCE/BINPERSID build plain descriptions. Any other opcode or global -> ShardBad.
    Hot opcodes are inlined (this loop is most of `quick`'s time); marks live on a separate
    stack as in CPython's own unpickler.
    """
    if len(data) > _MAX_PICKLE:
        raise ShardBad(f"pickle too large ({len(data)} bytes)")
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    pos, end = 0, len(data)
    u32 = _U32.unpack_from
    try:
        while True:
            op = data[pos]
            pos += 1
            if op == 0x71:  # BINPUT
                memo[data[pos]] = stack[-1]
                pos += 1
            elif op == 0x68:  # BINGET
                stack.append(memo[data[pos]])
                pos += 1
            elif op == 0x4B:  # BININT1
                stack.append(data[pos])
                pos += 1
            elif op == 0x28:  # MARK
                marks.append(len(stack))
            elif op == 0x58:  # BINUNICODE
                (n,) = u32(data, pos)
                pos += 4 + n
                if pos > end:
                    raise ShardBad("pickle truncated in a string")
                stack.append(data[pos - n : pos].decode("utf-8"))
            elif 0x85 <= op <= 0x87:  # TUPLE1..3
                n = op - 0x84
                if len(stack) < n:
                    raise ShardBad("pickle stack underflow")
                items = tuple(stack[-n:])
                del stack[-n:]
                stack.append(items)
            elif op == 0x52:  # REDUCE
                args = stack.pop()
                stack[-1] = _reduce(stack[-1], args, pos - 1)
            elif op == 0x74:  # TUPLE
                k = marks.pop()
                items = tuple(stack[k:])
                del stack[k:]
                stack.append(items)
            elif op == 0x51:  # BINPERSID
                stack[-1] = _storage_ref(stack[-1])
            elif op == 0x89:  # NEWFALSE
                stack.append(False)
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(())
            elif op == 0x63:  # GLOBAL
                nl1 = data.index(b"\n", pos)
                nl2 = data.index(b"\n", nl1 + 1)
                name = f"{_utf8(data[pos:nl1])}.{_utf8(data[nl1 + 1 : nl2])}"
                stack.append(_allowed_global(name, pos - 1))
                pos = nl2 + 1
            elif op == 0x75:  # SETITEMS
                k = marks.pop()
                items = stack[k:]
                del stack[k:]
                if len(items) % 2:
                    raise ShardBad("pickle SETITEMS with an odd item count")
                target = stack[-1]
                for i in range(0, len(items), 2):
                    _setitem(target, items[i], items[i + 1])
            elif op == 0x73:  # SETITEM
                value = stack.pop()
                key = stack.pop()
                _setitem(stack[-1], key, value)
            elif op == 0x7D:  # EMPTY_DICT
                stack.append({})
            elif op == 0x80:  # PROTO
                pos += 1
            elif op == 0x95:  # FRAME
                pos += 8
            elif op == 0x8C:  # SHORT_BINUNICODE
                n = data[pos]
                pos += 1 + n
                if pos > end:
                    raise ShardBad("pickle truncated in a string")
                stack.append(data[pos - n : pos].decode("utf-8"))
            elif op == 0x72:  # LONG_BINPUT
                memo[u32(data, pos)[0]] = stack[-1]
                pos += 4
            elif op == 0x94:  # MEMOIZE
                memo[len(memo)] = stack[-1]
            elif op == 0x6A:  # LONG_BINGET
                stack.append(memo[u32(data, pos)[0]])
                pos += 4
            elif op == 0x93:  # STACK_GLOBAL
                qual = stack.pop()
                module = stack.pop()
                if not isinstance(qual, str) or not isinstance(module, str):
                    raise ShardBad("pickle STACK_GLOBAL without names")
                stack.append(_allowed_global(f"{module}.{qual}", pos - 1))
            elif op == 0x4D:  # BININT2
                stack.append(data[pos] | data[pos + 1] << 8)
                pos += 2
            elif op == 0x4A:  # BININT
                stack.append(_I32.unpack_from(data, pos)[0])
                pos += 4
            elif op == 0x8A:  # LONG1
                n = data[pos]
                pos += 1 + n
                if pos > end:
                    raise ShardBad("pickle truncated in LONG1")
                stack.append(int.from_bytes(data[pos - n : pos], "little", signed=True))
            elif op == 0x88:  # NEWTRUE
                stack.append(True)
            elif op == 0x4E:  # NONE
                stack.append(None)
            elif op == 0x2E:  # STOP
                if len(stack) != 1 or marks:
                    raise ShardBad("pickle leaves data on the stack")
                if pos != end:
                    raise ShardBad("pickle has bytes after STOP")
                result = stack[0]
                if not isinstance(result, dict) or not all(
                    isinstance(v, TensorMeta) for v in result.values()
                ):
                    raise ShardBad("pickle is not a dict of tensors")
                return result
            else:
                raise ShardBad(f"pickle opcode 0x{op:02x} at byte {pos - 1} is not one torch.save writes")
    except IndexError:
        raise ShardBad("pickle truncated or stack underflow") from None
    except KeyError as e:
        raise ShardBad(f"pickle refers to unknown memo {e.args[0]}") from None
    except (struct.error, ValueError) as e:  # short struct read, missing newline, bad UTF-8
        raise ShardBad(f"pickle malformed: {e}") from None


def _utf8(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ShardBad("pickle string is not UTF-8") from None


def _allowed_global(name: str, at: int) -> _Global:
    if name not in _ALLOWED_GLOBALS:
        raise ShardBad(f"pickle names {name!r} at byte {at}: not a tensor (refused, nothing executed)")
    return _Global(name)


def _storage_ref(pid: Any) -> StorageRef:
    if (
        not isinstance(pid, tuple)
        or len(pid) != 5
        or pid[0] != "storage"
        or not isinstance(pid[1], _Global)
        or not pid[1].name.startswith("torch.")
        or not isinstance(pid[2], str)
        or not isinstance(pid[3], str)
        or not _is_int(pid[4])
        or pid[4] < 0
    ):
        raise ShardBad("pickle persistent id is not a torch storage reference")
    return StorageRef(key=pid[2], dtype=STORAGE_DTYPES[pid[1].name[6:]], location=pid[3], numel=pid[4])


def _reduce(func: Any, args: Any, at: int) -> Any:
    if not isinstance(func, _Global) or not isinstance(args, tuple):
        raise ShardBad(f"pickle REDUCE at byte {at} on something that is not an allowed global")
    if func.name == _ORDERED_DICT:
        if args:
            raise ShardBad("pickle builds an OrderedDict with arguments")
        return {}
    if func.name == _REBUILD:
        if len(args) not in (6, 7):
            raise ShardBad("tensor rebuild with unexpected arguments")
        storage, offset, shape, stride, requires_grad, hooks = args[:6]
        if (
            not isinstance(storage, StorageRef)
            or not _is_int(offset)
            or not _int_tuple(shape)
            or not _int_tuple(stride)
            or len(shape) != len(stride)
            or not isinstance(requires_grad, bool)
            or not isinstance(hooks, dict)
            or hooks
            or (len(args) == 7 and args[6] not in (None, {}))
        ):
            raise ShardBad("tensor rebuild with malformed arguments")
        return TensorMeta(storage, offset, shape, stride)
    raise ShardBad(f"pickle REDUCE at byte {at} calls {func.name!r} (refused, nothing executed)")


def _setitem(target: Any, key: Any, value: Any) -> None:
    if not isinstance(target, dict) or not isinstance(key, str):
        raise ShardBad("pickle SETITEM on something that is not a dict with string keys")
    target[key] = value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_tuple(v: Any) -> bool:
    return isinstance(v, tuple) and len(v) <= 8 and all(_is_int(x) for x in v)


# --- verification: one shard ----------------------------------------------------------------
LEVELS = ("quick", "full", "deep")


@dataclass
class Expect:
    """What run.json says every shard must hold."""

    hidden_size: int
    num_aux: int
    dtype: str
    vocab_size: int | None = None

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
        return cls(hidden, len(layer_ids), dtype, vocab if _is_int(vocab) else None)


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

        Records may be shared with a byte-identical layout (see _Layout), so for files held in
        memory the CRC is read from this file's own bytes, never from the shared record.
        """
        if self.data is not None:
            return _U32.unpack_from(self.data, rec.crc_at)[0]
        return rec.crc


class ShardIOError(Exception):
    """The shard could not be read (permissions, I/O error): not evidence of bad data."""


def inspect_shard(fd: int, expect: Expect, size: int | None = None, data: bytes | None = None) -> ShardInfo:
    """The `quick` level on an open file: zip structure + pickled metadata, nothing executed.

    `data`, when given, is the whole file as already read from `fd` (len(data) == size).
    """
    if size is None:
        size = os.fstat(fd).st_size
    if size == 0:
        raise ShardBad("empty file")
    reader = _Reader(fd, size, data)
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
        layouts.append(_Layout(info))
    return info


def _match_layout(data: bytes, expect: Expect) -> _Layout | None:
    """The remembered layout whose structural bytes `data` repeats exactly, if any."""
    for layout in _LAYOUTS.get((len(data), expect.hidden_size, expect.num_aux, expect.dtype), ()):
        if layout.get(data) == layout.fingerprint:
            return layout
    return None


def _varies(name: str) -> bool:
    """Records whose bytes differ between shards of one layout: tensor storages, the save's id."""
    return "/data/" in name or name.endswith("/.data/serialization_id")


class _Layout:
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
        assert info.data is not None
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


_LAYOUTS: dict[tuple[int, int, int, str], list[_Layout]] = {}


def _inspect(reader: _Reader, expect: Expect) -> ShardInfo:
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
    if f"{prefix}/version" not in by_name:
        raise ShardBad("no version record")
    order = by_name.get(f"{prefix}/byteorder")
    if order is not None and reader.read(order.data_offset, order.size) != b"little":
        raise ShardBad("byteorder record is not 'little'")
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

    `full` is bound by CRC32 speed. zlib's runs at ~1.7-2 GB/s per core; ISA-L (`pip install
    isal`) and zlib-ng (`pip install zlib-ng`) use carry-less multiplication and run ~2.5-3x
    faster. Both are optional: a library is used only after it reproduces zlib's results here,
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
    for _ in range(32):
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
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise ShardBad("file disappeared during verification") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ShardBad("a symlink, not a regular file") from None
        raise ShardIOError(f"{path}: cannot open: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ShardBad("not a regular file")
        size = st.st_size
        try:
            data = None
            if 0 < size <= _SMALL_FILE:  # one read serves the whole structure check
                data = os.pread(fd, size, 0)
                if len(data) != size:
                    raise ShardBad(f"file changed while reading ({len(data)} of {size} bytes)")
                if level == "quick":  # the hot path: a known layout needs no ShardInfo
                    layout = _match_layout(data, expect)
                    if layout is not None:
                        _check_entry(entry, size, layout.info.num_tokens)
                        return size, layout.info.num_tokens
            info = inspect_shard(fd, expect, size, data)
            read = info.size if info.size <= _SMALL_FILE else 0
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


_FORK_MIN_QUICK = 1000  # below this many files a `quick` run is faster than forking workers


def usable_cores() -> int:
    """Cores this process may use: its affinity (taskset, a cpuset), capped by a CFS quota (a
    container's --cpus, a k8s CPU limit, systemd's CPUQuota=) rounded up; not the host's count.

    A quota leaves every core visible and lets the process run only so many core-seconds a
    period: threads sized by the affinity alone then queue for the quota and stall each other."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return cores if limit is None else max(1, min(cores, math.ceil(limit - 1e-9)))


def cgroup_cpu_limit(
    proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo"
) -> float | None:
    """CPUs' worth a CFS quota allows this process (the tightest of its cgroup and the cgroups
    above it: v2 `cpu.max`, v1 `cpu.cfs_quota_us`), or None where none is set or readable. The
    hierarchies are found where they are mounted (v2 alone, v1 alone, or both on a hybrid host)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    v2_mounts, v1_mounts = _cgroup_mounts(mountinfo)
    limits: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2, unified: "max 100000" or "150000 100000"
            for mount_root, mount_point in v2_mounts:
                limits += _quota_walk(mount_point, _below(path, mount_root), _v2_limit)
        elif "cpu" in controllers.split(","):
            for mount_root, mount_point in v1_mounts:
                limits += _quota_walk(mount_point, _below(path, mount_root), _v1_limit)
    return min(limits) if limits else None


def _cgroup_mounts(mountinfo: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(root within the hierarchy, mount point) of the cgroup2 mounts and of the v1 mounts with
    the cpu controller, from mountinfo ("... root mountpoint opts ... - fstype source superopts")."""
    v2: list[tuple[str, str]] = []
    v1: list[tuple[str, str]] = []
    try:
        with open(mountinfo) as f:
            rows = f.read().splitlines()
    except OSError:
        return v2, v1
    for row in rows:
        head, sep, tail = row.partition(" - ")
        fields, more = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(more) < 3:
            continue
        root, point = fields[3], fields[4].replace("\\040", " ")
        if more[0] == "cgroup2":
            v2.append((root, point))
        elif more[0] == "cgroup" and "cpu" in more[2].split(","):
            v1.append((root, point))
    return v2, v1


def _below(path: str, mount_root: str) -> str:
    """The cgroup's folder under a mount of the hierarchy from `mount_root` on (a container's
    mount shows its own cgroup as the root: its /proc path is the host's view)."""
    root = mount_root.rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    return path


def _quota_walk(mount: str, path: str, read: Callable[[str], float | None]) -> list[float]:
    """The limits set on `path`'s cgroup and its parents under `mount` (a path absent there, a
    host's view seen from a container, ends at the mount all the same)."""
    rel = path.strip("/")
    found = []
    while True:
        limit = read(os.path.join(mount, rel))
        if limit is not None:
            found.append(limit)
        if not rel:
            return found
        rel = os.path.dirname(rel)


def _v2_limit(cgroup: str) -> float | None:
    try:
        with open(os.path.join(cgroup, "cpu.max")) as f:
            quota, _, period = f.read().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_limit(cgroup: str) -> float | None:
    try:
        with open(os.path.join(cgroup, "cpu.cfs_quota_us")) as f:
            quota = int(f.read().strip())
        with open(os.path.join(cgroup, "cpu.cfs_period_us")) as f:
            period = int(f.read().strip())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError, ZeroDivisionError):
        return None


def default_workers() -> int:
    """Verification workers when none are asked for: every core but one (left for the listing
    that runs alongside the workers, _quick_split), at most 16; all of them on 1-2 cores.

    `quick` is system calls and layout learning spread over the workers: on a 16-core host, a
    first verification of 10,000 small shards took 84-108 ms (median) with 8 workers and
    78 ms with 15 (docs/benchmarks.md, "quick, fifth pass").
    """
    cpus = usable_cores()
    return cpus if cpus <= 2 else min(16, cpus - 1)


# List the folders while the forked workers check (True), before (False), or None: alongside when
# the workers leave a core free (_quick_split).
_LIST_ALONGSIDE: bool | None = None
# Full checks after the listing (no index entry, not a regular file) are forked from this many.
_FORK_MIN_REDO = 256
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


# --- verification: a whole output directory -------------------------------------------------
@dataclass
class BadShard:
    sample_id: str | None
    path: str
    reason: str


@dataclass
class VerifyReport:
    level: str
    checked: int = 0
    ok: int = 0
    bad: list[BadShard] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unindexed: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    orphans_removed: int = 0
    quarantined: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    index_bad_lines: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        """0 all good, 1 bad or missing shards, 2 I/O errors (then nothing was moved)."""
        if self.errors:
            return 2
        return 1 if self.bad or self.missing else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "checked": self.checked,
            "ok": self.ok,
            "bad": [asdict(b) for b in self.bad],
            "missing": self.missing,
            "unindexed": self.unindexed,
            "orphans_removed": self.orphans_removed,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "orphans": self.orphans,
            "quarantined": self.quarantined,
            "errors": self.errors,
            "index_bad_lines": self.index_bad_lines,
        }


_INDEX_PATH = re.compile(rf"^{SHARDS_DIR}/[0-9a-f]{{{BUCKET_HEX_CHARS}}}/[^/]+\.pt$")


def scan_shards(output_dir: str) -> list[str]:
    """Relative paths of every `.pt` entry in shards/<bucket>/ (regular files or not)."""
    return _scan(output_dir, orphans=None)


def _scan_top(output_dir: str, orphans: list[str] | None) -> list[str]:
    """The bucket folders of shards/ (sorted); temps in the output root and shards/ go to `orphans`."""
    if orphans is not None:
        with os.scandir(output_dir) as it:
            orphans.extend(e.name for e in it if is_temp_name(e.name) and e.is_file(follow_symlinks=False))
    try:
        with os.scandir(os.path.join(output_dir, SHARDS_DIR)) as it:
            entries = list(it)
    except FileNotFoundError:
        return []
    if orphans is not None:
        orphans.extend(
            f"{SHARDS_DIR}/{e.name}"
            for e in entries
            if is_temp_name(e.name) and e.is_file(follow_symlinks=False)
        )
    return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))


def _scan(output_dir: str, orphans: list[str] | None) -> list[str]:
    """scan_shards, also collecting find_orphan_temps' list into `orphans` in the same pass."""
    found: list[str] = []
    buckets = _scan_top(output_dir, orphans)
    root = os.path.join(output_dir, SHARDS_DIR)
    suffix, temp = SHARD_SUFFIX, TEMP_PREFIX
    for b in buckets:
        prefix = f"{SHARDS_DIR}/{b}/"
        with os.scandir(os.path.join(root, b)) as it:
            for e in it:
                name = e.name
                if name.endswith(suffix) and not name.startswith(temp):
                    found.append(prefix + name)
                elif orphans is not None and is_temp_name(name) and e.is_file(follow_symlinks=False):
                    orphans.append(prefix + name)
    found.sort()
    if orphans is not None:
        orphans.sort()
    return found


def _check_batch(
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


def _fork_map(
    fn: Callable[..., Any], parts: list[tuple[Any, ...]], reap: list[int] | None = None
) -> list[Any]:
    """[fn(*p) for p in parts]: parts[1:] each in a forked child, parts[0] in this process.

    Children inherit everything (no pickling of the work) and send back one pickled result
    through a pipe. Cheaper than a process pool (~0.1 s to start) for `quick`, whose whole
    run may take less than that. A child that dies without a result is an error, not a pass.
    With `reap` (a list), a child whose whole result arrived is not waited for here: its pid
    goes into `reap` for the caller to wait for later (_reap), so that its exit (unmapping a
    copy of a large parent, ~10 ms with torch loaded) overlaps the caller's work.
    """
    import pickle

    children = []
    for part in parts[1:]:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: never return into the caller's code
            code = 0
            try:
                os.close(r)
                payload = pickle.dumps(fn(*part), protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException as e:  # report it; the parent raises
                payload, code = pickle.dumps(RuntimeError(f"verify worker failed: {e!r}")), 1
            try:
                view = memoryview(payload)
                while view:
                    view = view[os.write(w, view) :]
                os.close(w)  # the result is complete before this process starts to exit
            finally:
                os._exit(code)
        os.close(w)
        children.append((pid, r))
    try:
        results = [fn(*parts[0])]
    except BaseException:  # this process failed: wait for every child, then raise
        for pid, r in children:
            with os.fdopen(r, "rb") as f:
                f.read()
            os.waitpid(pid, 0)
        raise
    pending = []
    for pid, r in children:
        with os.fdopen(r, "rb") as f:
            pending.append((pid, f.read()))
    error: BaseException | None = None
    for pid, data in pending:
        try:
            result = pickle.loads(data) if data else None
        except Exception:  # cut short: the child died while writing it
            result = None
        if reap is not None and result is not None and not isinstance(result, BaseException):
            reap.append(pid)
        else:
            _, status = os.waitpid(pid, 0)
            if error is None and (status != 0 or result is None or isinstance(result, BaseException)):
                error = (
                    result
                    if isinstance(result, BaseException)
                    else RuntimeError(f"verify worker died (wait status {status})")
                )
        results.append(result)
    if error is not None:
        raise error
    return results


_EXITING: list[int] = []  # forked workers that sent their result and may still be exiting


def _reap(pids: list[int]) -> None:
    """Collect the children _fork_map left to the caller, without waiting for any still exiting.

    A worker that has sent its whole result only has its exit left, which for the copy of a
    large parent (torch loaded) takes ~10 ms of unmapping: it runs while the caller goes on,
    and the child is collected here on a later call (as subprocess does), or by init.
    """
    _EXITING.extend(pids)
    pids.clear()
    for pid in list(_EXITING):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # collected by someone else's wait()
            done = pid
        if done:
            _EXITING.remove(pid)


_FAST_OPEN = _OPEN_FLAGS | getattr(os, "O_CLOEXEC", 0)
_DIR_OPEN = (
    os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
)
_DIR_FD = os.open in os.supports_dir_fd and os.scandir in os.supports_fd
_LINE_BODY = operator.itemgetter(slice(None, -10))
_LINE_CRC = operator.itemgetter(slice(-9, -1))
_LINE_TAB = operator.itemgetter(slice(-10, -9))
_ROW = operator.itemgetter("id", "path", "size", "checksum", "num_tokens")  # IndexEntry's field order
_BY_SIZE = operator.itemgetter(0)
_ROW_TOKENS = operator.itemgetter(4)
_MAX_DIR_FDS = 512  # bucket folders a quick worker keeps open (more are opened by path)

# An index entry as `quick` passes it around: (sample_id, path, size, checksum, num_tokens).
_Row = tuple[str, str, int, str, int]


def _index_rows(lines: list[bytes]) -> dict[str, _Row] | None:
    """_replay_index's entries as rows, for an index of only lines as encode_index_line writes
    entries (no tombstones, no damaged or torn line): then every line passes, and each check is
    one C-level pass over all lines. Any other index: None (the caller replays it line by line).
    """
    if not lines or lines[-1][-1:] != b"\n":
        return None
    bodies = list(map(_LINE_BODY, lines))
    crcs = struct.pack(f">{len(bodies)}I", *map(zlib.crc32, bodies)).hex().encode("ascii")
    if b"".join(map(_LINE_CRC, lines)) != crcs or b"".join(map(_LINE_TAB, lines)) != b"\t" * len(lines):
        return None
    try:
        records = json.loads(b"[" + b",".join(bodies) + b"]")
        rows = list(map(_ROW, records))  # KeyError: a tombstone or another record
    except (ValueError, KeyError, TypeError):
        return None
    if set(map(len, records)) != {5}:  # other keys too (one may be "removed")
        return None
    ids, paths, sizes, checksums, tokens = zip(*rows, strict=True)
    if set(map(type, ids + paths + checksums)) != {str} or set(map(type, sizes + tokens)) != {int}:
        return None  # read_index would convert these (or count the line bad)
    return dict(zip(ids, rows, strict=True))  # later lines win


class _QuickWorker:
    """`quick` over bucket folders: list them (list), check their shards (_check) - both in one
    process, or the listing here and the checking in chunks of sizes taken by forked workers
    (_quick_split, _Chunks).

    The fast path, for a shard of a layout already seen (_Layout) whose index entry gives its
    size: the listing's d_type says it is a regular file; open it relative to its folder
    (O_NOFOLLOW: never through a symlink; O_NONBLOCK: a FIFO swapped in cannot block), one pread
    of one byte more than the index says, close: three system calls, no fstat. A pread returns
    less than asked only at the end of the file, so reading exactly the indexed size means the
    file has that size, as fstat would have said (a directory or FIFO swapped in fails the read).
    Those bytes matching a known layout, with the indexed token count, is check_shard's own fast
    path, so the shard passes. Anything else (no entry, no known layout of that size, not a
    regular file per the listing, an open or read error, another length, other bytes or token
    count) goes to check_shard as before, which gives the verdict and its reason itself (and
    learns the layout of a small shard that passes).
    """

    def __init__(self, output_dir: str, buckets: list[str], expect: Expect, by_path: dict[str, _Row]):
        self.output_dir = output_dir
        self.root = output_dir.rstrip("/") + "/" if output_dir else ""
        self.buckets, self.expect, self.by_path = buckets, expect, by_path
        self.files: list[str] = []  # every shard-named entry listed (relative paths)
        self.ok = self.nbytes = 0
        self.problems: list[tuple[str, str, str]] = []
        self.orphans: list[str] = []
        self.unindexed: list[str] = []  # shards with no index entry
        self.error: tuple[int, OSError] | None = None  # the first folder that could not be listed

    def run(self, take: Iterable[int], progress: Callable[[int, int, int], None] | None = None) -> tuple:
        """List the folders `take` names, then check their shards (one process, no split)."""
        fds: list[int] = []
        try:
            jobs = self.list(take, fds)
            if jobs is not None:
                self._check(jobs, progress)
        finally:
            for fd in fds:
                os.close(fd)
        return self._result()

    def list(self, take: Iterable[int], fds: list[int], opened: dict[str, int] | None = None) -> list | None:
        """The shards of the folders `take` names as jobs in order of indexed size; None when a
        folder could not be listed (self.error says which). Folder fds opened go into `fds`;
        `opened` gives folders already open (bucket -> fd, closed by the caller).

        Shards of one size share a layout: checked one after another, its bytes stay in the
        CPU's cache instead of being fetched again for every file (runs have ~2k lengths).
        """
        jobs: list[tuple[int, str, int | None, str, _Row | None, bool]] = []
        for i in take:
            try:
                self._list(i, fds, jobs, (opened or {}).get(self.buckets[i]))
            except OSError as e:
                self.error = (i, e)
                return None
        jobs.sort(key=_BY_SIZE)
        return jobs

    def _result(self) -> tuple:
        return self.files, self.ok, self.nbytes, self.problems, self.orphans, self.unindexed, self.error

    def _list(self, i: int, fds: list[int], jobs: list, fd: int | None = None) -> None:
        """List folder i (through `fd` when it is open already): its shards become jobs
        (indexed size, path to open, folder fd, rel, row, regular)."""
        path = os.path.join(self.output_dir, SHARDS_DIR, self.buckets[i])
        prefix = f"{SHARDS_DIR}/{self.buckets[i]}/"
        if fd is not None:
            with os.scandir(fd) as it:
                entries = list(it)
        elif _DIR_FD and len(fds) < _MAX_DIR_FDS:
            try:
                fd = os.open(path, _DIR_OPEN)
            except OSError:
                fd = None  # listed by name below, which fails (or not) as it always did
            if fd is not None:
                try:
                    with os.scandir(fd) as it:
                        entries = list(it)
                except OSError:
                    os.close(fd)
                    fd = None
                else:
                    fds.append(fd)
        if fd is None:
            with os.scandir(path) as it:
                entries = list(it)
        base = "" if fd is not None else self.root + prefix
        append, get, files = jobs.append, self.by_path.get, self.files
        suffix, temp, small = SHARD_SUFFIX, TEMP_PREFIX, _SMALL_FILE
        for e in entries:
            name = e.name
            if not name.endswith(suffix) or name.startswith(temp):
                if is_temp_name(name) and self._is_file(e, prefix):
                    self.orphans.append(prefix + name)
                continue
            rel = prefix + name
            files.append(rel)
            row = get(rel)
            if row is None:
                self.unindexed.append(rel)
                size = 0
            else:
                size = row[2] if 0 < row[2] <= small else 0
            try:
                regular = e.is_file(follow_symlinks=False)  # d_type: no system call
            except OSError:
                regular = False
            append((size, base + name, fd, rel, row, regular))

    def _check(self, jobs: list, progress: Callable[[int, int, int], None] | None) -> None:
        """The jobs (sorted by size) one size at a time (_check_size), progress every 256 shards."""
        total, done = len(jobs), 0
        for size, same in itertools.groupby(jobs, _BY_SIZE):
            group = list(same)
            self._check_size(size, group)
            done += len(group)
            if progress and (done - len(group)) >> 8 != done >> 8:
                progress(done, total, self.nbytes)
        if progress:
            progress(total, total, self.nbytes)

    def _check_size(self, size: int, group: list) -> None:
        """Shards of one indexed size: read them all, then compare them with the layout known for
        that size in C-level passes (map), so a shard costs little Python beyond its three system
        calls. With no layout known yet, the first shard that passes the full structure check on
        the bytes already read teaches it (_learn). A shard that fails any of it goes to _slow for
        its verdict and reason.
        """
        if not size:  # no indexed size, or too big for one read: each gets the full check
            for job in group:
                self._slow(job[3], job[4])
            return
        # The listing says something else than a regular file: never opened here.
        if not all(job[5] for job in group):
            for job in group:
                if not job[5]:
                    self._slow(job[3], job[4])
            group = [job for job in group if job[5]]
            if not group:
                return
        _, paths, dir_fds, _, rows, _ = zip(*group, strict=True)
        datas = _read_files(paths, dir_fds, size + 1)  # +1: a longer file reads longer and fails the compare
        key = (size, self.expect.hidden_size, self.expect.num_aux, self.expect.dtype)
        start = 0
        while not _LAYOUTS.get(key) and start < len(group):
            if not self._learn(datas[start], rows[start], size):
                self._slow(group[start][3], rows[start])
            start += 1
        if start:
            group, datas, rows = group[start:], datas[start:], rows[start:]
            if not group:
                return
        known = _LAYOUTS[key]
        layout = known[0]
        matched = list(map(layout.fingerprint.__eq__, map(layout.get, datas)))  # length, too: see _Layout
        tokens = list(map(layout.info.num_tokens.__eq__, map(_ROW_TOKENS, rows)))
        if all(matched) and all(tokens):
            self.ok += len(group)
            self.nbytes += size * len(group)
            return
        for job, data, match, token in zip(group, datas, matched, tokens, strict=True):
            if not match:
                other = next((lo for lo in known[1:] if lo.get(data) == lo.fingerprint), None)
                match, token = other is not None, other is not None and other.info.num_tokens == job[4][4]
            if match and token:
                self.ok += 1
                self.nbytes += size
            else:
                self._slow(job[3], job[4])

    def _learn(self, data: bytes, row: _Row, size: int) -> bool:
        """check_shard's quick verdict on bytes already read, when it is a pass: the whole file
        (a regular file per the listing; exactly the indexed size, since the read asked for one
        byte more), the structure check (inspect_shard, which remembers the layout) and the
        indexed token count. False for anything else: _slow then gives the verdict and reason.
        """
        if len(data) != size:
            return False
        try:
            info = inspect_shard(-1, self.expect, size, data)
        except ShardBad:
            return False
        if info.num_tokens != row[4]:
            return False
        self.ok += 1
        self.nbytes += size
        return True

    def _is_file(self, e: os.DirEntry, prefix: str) -> bool:
        """e.is_file(follow_symlinks=False), failing with the path _scan's listing would name."""
        try:
            return e.is_file(follow_symlinks=False)
        except OSError:
            try:
                return stat.S_ISREG(os.lstat(self.root + prefix + e.name).st_mode)
            except FileNotFoundError:
                return False

    def _slow(self, rel: str, row: _Row | None) -> None:
        """check_shard on one file, through _check_batch (its verdict and reason)."""
        entry = IndexEntry(*row) if row is not None else None
        _, ok, nbytes, problems = _check_batch(self.output_dir, [(rel, entry)], "quick", self.expect, None)
        self.ok += ok
        self.nbytes += nbytes
        self.problems.extend(problems)


def _read_files(paths: Iterable[str], dir_fds: Iterable[int | None], want: int) -> list[bytes]:
    """The first `want` bytes of each file (opened relative to its folder's fd, never through a
    symlink, never blocking); b"" for one that cannot be opened or read (the full check says why).
    """
    out: list[bytes] = []
    append = out.append
    op, pread, close, flags = os.open, os.pread, os.close, _FAST_OPEN
    pairs = zip(paths, dir_fds, strict=True)
    done = False
    while not done:
        try:
            for path, dir_fd in pairs:
                f = op(path, flags, dir_fd=dir_fd)
                try:
                    data = pread(f, want, 0)
                finally:
                    close(f)
                append(data)
            done = True
        except OSError:  # this file only; the loop goes on with the next
            append(b"")
    return out


_LEARN_WEIGHT = 24  # a size's first shard (full check, layout learnt) costs ~this many fast-path shards
_SLOW_WEIGHT = 24  # a shard without a fast path (no index entry, or too big): a full check


def _split_by_size(jobs: list, n: int) -> list[list]:
    """Jobs sorted by size cut into n contiguous shares of about equal cost, never inside a
    size's group (so each size's layout is learnt by one worker only, once per verification).
    Size 0 (no fast path: each job a full check) is cut anywhere: on real, large shards it is
    every job.
    """
    costs = []
    for i, job in enumerate(jobs):
        if job[0] == 0:
            costs.append(_SLOW_WEIGHT)
        else:
            costs.append(1 + (_LEARN_WEIGHT if i == 0 or jobs[i - 1][0] != job[0] else 0))
    total = sum(costs)
    shares: list[list] = []
    start = acc = 0
    for i, cost in enumerate(costs):
        if len(shares) == n - 1:
            break
        if acc >= total * (len(shares) + 1) / n and (jobs[i][0] == 0 or jobs[i][0] != jobs[i - 1][0]):
            shares.append(jobs[start:i])
            start = i
        acc += cost
    shares.append(jobs[start:])
    return shares + [[] for _ in range(n - len(shares))]


_CHUNKS_PER_WORKER = 4
_CHUNK_ID = struct.Struct("<H")


class _Chunks:
    """Jobs cut by size (_split_by_size) into a few chunks per worker, handed out one at a time
    through a pipe filled and closed for writing before the fork: a worker that runs slower (its
    hyperthread sibling busy, forked later, or the parent listing first) takes fewer, so all end
    together. A read of 2 bytes from the pipe is one chunk id, whole; an empty read: all taken.
    """

    def __init__(self, jobs: list, workers: int):
        self.chunks = [c for c in _split_by_size(jobs, min(workers * _CHUNKS_PER_WORKER, 0xFFFF)) if c]
        r, w = os.pipe()
        try:
            data = b"".join(map(_CHUNK_ID.pack, range(len(self.chunks))))
            while data:  # a few hundred bytes at most: far below a pipe's capacity
                data = data[os.write(w, data) :]
        finally:
            os.close(w)
        self.fd = r

    def check(self, lister: _QuickWorker) -> tuple:
        """Check chunks until none is left (in whichever process calls it); the checks' result."""
        worker = _QuickWorker(lister.output_dir, lister.buckets, lister.expect, lister.by_path)
        while len(got := os.read(self.fd, _CHUNK_ID.size)) == _CHUNK_ID.size:
            worker._check(self.chunks[_CHUNK_ID.unpack(got)[0]], None)
        return worker._result()

    def close(self) -> None:
        os.close(self.fd)


def _quick_split(
    output_dir: str, buckets: list[str], expect: Expect, by_path: dict[str, _Row], n: int, reap: list[int]
) -> list[tuple]:
    """`quick` in n forked workers, split by size, each size's layout learnt by one worker
    instead of by every worker (most of a first verification's cost when shards are small:
    ~0.1 ms per length, runs have ~2k).

    The workers check the shards the index names, opened relative to their folders (opened here
    before the fork), while this process lists the folders and then joins them (_Chunks): the
    listing (~15 ms for 10k shards) is no longer ahead of every check - when a core is left for
    it (n < CPUs; on 2 cores with 2 workers it slowed the checks more than it saved: 125 -> 149
    ms). The listing then reconciles (_reconcile): a shard it did not find is missing (whatever
    a worker made of it), one that is not a regular file per the listing, or not in the index,
    gets the full check here. When a folder cannot be opened, everything is listed first
    (_quick_split_listed), which reports the folder as before.
    """
    lister = _QuickWorker(output_dir, buckets, expect, by_path)
    opened: dict[str, int] = {}
    try:
        alongside = _LIST_ALONGSIDE if _LIST_ALONGSIDE is not None else n < usable_cores()
        if not alongside or len(buckets) > _MAX_DIR_FDS or not _DIR_FD:
            return _quick_split_listed(lister, n, reap)
        root = os.path.join(output_dir, SHARDS_DIR)
        for b in buckets:
            try:
                opened[b] = os.open(os.path.join(root, b), _DIR_OPEN)
            except OSError:
                return _quick_split_listed(lister, n, reap)
        jobs = _indexed_jobs(by_path, opened)
        chunks = _Chunks(jobs, n)
        try:
            parts = _fork_map(
                _quick_part,
                [("list", lister, opened, chunks), *[("check", lister, opened, chunks)] * n],
                reap,
            )
        finally:
            chunks.close()
        listed, own = parts[0]
        return _reconcile(lister, listed, [own, *parts[1:]], jobs, n, reap)
    finally:
        for fd in opened.values():
            os.close(fd)


def _quick_split_listed(lister: _QuickWorker, n: int, reap: list[int]) -> list[tuple]:
    """List every folder here, then check the listed shards in n processes split by size."""
    fds: list[int] = []
    try:
        jobs = lister.list(range(len(lister.buckets)), fds)
        if jobs is None:
            return [lister._result()]
        parts = _check_in_chunks(lister, jobs, n, reap)
    finally:
        for fd in fds:
            os.close(fd)
    return [lister._result(), *parts]


def _check_in_chunks(lister: _QuickWorker, jobs: list, n: int, reap: list[int]) -> list[tuple]:
    """Check `jobs` in n processes (this one and n - 1 forked) taking chunks of sizes (_Chunks)."""
    chunks = _Chunks(jobs, n)
    try:
        return _fork_map(_Chunks.check, [(chunks, lister)] * n, reap)
    finally:
        chunks.close()


def _indexed_jobs(by_path: dict[str, _Row], opened: dict[str, int]) -> list:
    """The index's shards as jobs (sorted by size), each opened relative to its open folder;
    a shard whose folder is not there is not a job (the listing reports it missing)."""
    start = len(SHARDS_DIR) + 1
    end = start + BUCKET_HEX_CHARS
    small = _SMALL_FILE
    jobs = []
    append = jobs.append
    for rel, row in by_path.items():  # rel matched _INDEX_PATH: shards/<bucket>/<name>.pt
        fd = opened.get(rel[start:end])
        if fd is not None:
            append((row[2] if 0 < row[2] <= small else 0, rel[end + 1 :], fd, rel, row, True))
    if "\0" in (names := "".join(by_path)) or not _encodable(names):  # a made-up index: no such file
        jobs = [job for job in jobs if "\0" not in job[3] and _encodable(job[3])]
    jobs.sort(key=_BY_SIZE)
    return jobs


def _encodable(name: str) -> bool:
    """The name can be a path here (a lone surrogate in a hand-made index cannot)."""
    try:
        os.fsencode(name)
    except UnicodeError:
        return False
    return True


def _quick_part(kind: str, lister: _QuickWorker, opened: dict[str, int], chunks: _Chunks) -> Any:
    """_quick_split's work for _fork_map: "list" (here) the open folders, then check chunks of
    the index's jobs like the workers: (listing, checks); "check" (a forked worker): checks."""
    if kind == "list":
        return lister.list(range(len(lister.buckets)), [], opened), chunks.check(lister)
    return chunks.check(lister)


def _reconcile(
    lister: _QuickWorker, listed: list | None, checked: list[tuple], jobs: list, n: int, reap: list[int]
) -> list[tuple]:
    """The workers' verdicts, corrected by the listing: a shard the listing did not find is
    missing (its verdict dropped); one it says is not a regular file, or that has no index
    entry, gets the full check now (in n workers when there are many)."""
    if listed is None:  # a folder could not be listed: _merge_quick reports it
        return [lister._result()]
    parts = [list(p) for p in checked]
    irregular = [job for job in listed if job[4] is not None and not job[5]]
    drop = {job[3] for job in irregular}
    if len(lister.files) - len(lister.unindexed) != len(lister.by_path):
        drop |= lister.by_path.keys() - set(lister.files)
    if drop and parts:
        judged = {job[3] for job in jobs} & drop  # checked by a worker: one verdict each
        for p in parts:
            bad = {rel for rel, _, _ in p[3]}
            p[3] = [problem for problem in p[3] if problem[0] not in drop]
            judged -= bad & drop
        parts[0][1] -= len(judged)  # passed: counted ok, with the bytes a quick pass counts
        parts[0][2] -= sum(size for rel in judged if (size := lister.by_path[rel][2]) <= _SMALL_FILE)
    redo = sorted((job for job in listed if job[4] is None or not job[5]), key=_BY_SIZE)
    if redo:
        parts += _check_in_chunks(lister, redo, n if len(redo) >= _FORK_MIN_REDO else 1, reap)
    return [lister._result(), *map(tuple, parts)]


def _verify_quick(
    output_dir: str,
    expect: Expect,
    lines: list[bytes],
    report: VerifyReport,
    workers: int,
    progress: Callable[[int, int, int], None] | None,
) -> tuple[list[tuple[str, str, str]], dict[str, _Row]]:
    """verify_output for `quick` from the index's lines: (problems, by_path), the report filled.

    One process lists every bucket folder (_QuickWorker.list); with workers > 1 the shards are
    then checked by forked workers, split by size (_quick_split). Verdicts, reasons and every
    list in the report are those _scan + _check_batch give, in the same order.
    """
    entries = _index_rows(lines)
    by_path: dict[str, _Row] = {}
    if entries is not None:  # every line good: the checks below in one pass each
        paths = [row[1] for row in entries.values()]
        if len(set(paths)) == len(paths) and all(map(_INDEX_PATH.match, paths)):
            by_path = dict(zip(paths, entries.values(), strict=True))  # ("..": never in a path that matches)
        else:
            entries = None
    if entries is None:
        state = _replay_index(lines)
        report.index_bad_lines = state.bad_lines
        entries = {}
        for sid, entry in sorted(state.entries.items()):
            if not _INDEX_PATH.match(entry.path) or ".." in entry.path.split("/"):
                report.bad.append(
                    BadShard(sid, entry.path, "index entry points outside shards/ (not touched)")
                )
            else:
                row = (sid, entry.path, entry.size, entry.checksum, entry.num_tokens)
                entries[sid] = by_path[entry.path] = row
    try:
        buckets = _scan_top(output_dir, report.orphans)
    except PermissionError as e:
        raise ManifestError(f"{e.filename}: cannot list: {e.strerror}") from None
    n = min(workers, len(buckets))
    reap: list[int] = []
    try:
        if n > 1 and len(entries) >= _FORK_MIN_QUICK and hasattr(os, "fork"):
            parts = _quick_split(output_dir, buckets, expect, by_path, n, reap)
            live = progress
        else:
            parts = [_QuickWorker(output_dir, buckets, expect, by_path).run(range(len(buckets)), progress)]
            live = None  # progress was reported while checking
        problems = _merge_quick(report, parts, by_path, entries, live)
    finally:
        _reap(reap)
    return problems, by_path


def _merge_quick(
    report: VerifyReport,
    parts: list[tuple],
    by_path: dict[str, _Row],
    entries: dict[str, _Row],
    progress: Callable[[int, int, int], None] | None,
) -> list[tuple[str, str, str]]:
    """The workers' results into the report: counts, orphans, missing and unindexed shards."""
    failed = [p[6] for p in parts if p[6] is not None]
    if failed:
        e = min(failed, key=lambda f: f[0])[1]
        if isinstance(e, PermissionError):
            raise ManifestError(f"{e.filename}: cannot list: {e.strerror}") from None
        raise e
    total = sum(len(p[0]) for p in parts)
    problems: list[tuple[str, str, str]] = []
    found = 0
    for files, ok, nbytes, part_problems, orphans, unindexed, _ in parts:
        report.checked += len(files)
        report.ok += ok
        report.bytes += nbytes
        problems.extend(part_problems)
        report.orphans.extend(orphans)
        report.unindexed.extend(unindexed)
        found += len(files) - len(unindexed)
        if progress:
            progress(report.checked, total, report.bytes)
    report.orphans.sort()
    report.unindexed.sort()
    if found != len(by_path):  # some indexed shards are not on disk: which (by sample id)
        gone = by_path.keys() - {rel for p in parts for rel in p[0]}
        report.missing = sorted(sid for sid, row in entries.items() if row[1] in gone)
    return problems


def verify_output(
    output_dir: str,
    level: str = "quick",
    *,
    quarantine: bool = False,
    check_mode: bool = False,
    workers: int = 1,
    deep_check: Callable[[str, Expect, ShardInfo], str | None] | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    orphan_min_age: float = 600.0,
) -> VerifyReport:
    """Verify every shard of a run, reconcile with the index, and (if asked) quarantine.

    With quarantine and not check_mode: bad shards move to quarantine/ with a reason file,
    index tombstones make bad and missing samples "not done", and writer temps older than
    orphan_min_age seconds are deleted (younger ones may belong to a live writer). Nothing
    moves when any file could not be read (report.errors) - an I/O problem is not bad data.
    Raises ManifestError when output_dir is not a run.
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")
    if level == "deep" and deep_check is None:
        raise ValueError("level 'deep' needs a deep_check (it loads tensors with torch)")
    started = time.monotonic()
    if not os.path.isdir(output_dir):
        raise ManifestError(f"{output_dir}: not a directory")
    expect = Expect.from_manifest(read_manifest_dict(output_dir), os.path.join(output_dir, MANIFEST_NAME))
    report = VerifyReport(level=level)
    try:
        lines = _read_index_lines(output_dir)
    except PermissionError as e:
        raise ManifestError(f"{os.path.join(output_dir, INDEX_NAME)}: cannot read: {e.strerror}") from None
    if level == "quick":
        problems, rows = _verify_quick(output_dir, expect, lines, report, workers, progress)
        _report_problems(report, problems, {rel: rows[rel][0] for rel, _, _ in problems if rel in rows})
        return _finish(report, output_dir, level, quarantine, check_mode, orphan_min_age, started)
    state = _replay_index(lines)
    report.index_bad_lines = state.bad_lines
    try:
        on_disk = _scan(output_dir, report.orphans)
    except PermissionError as e:
        raise ManifestError(f"{e.filename}: cannot list: {e.strerror}") from None

    disk_set = set(on_disk)
    by_path: dict[str, IndexEntry] = {}
    for sid, entry in sorted(state.entries.items()):
        if not _INDEX_PATH.match(entry.path) or ".." in entry.path.split("/"):
            report.bad.append(BadShard(sid, entry.path, "index entry points outside shards/ (not touched)"))
        elif entry.path not in disk_set:
            report.missing.append(sid)
        else:
            by_path[entry.path] = entry
    report.unindexed = [p for p in on_disk if p not in by_path]
    jobs = [(p, by_path.get(p)) for p in on_disk]

    problems: list[tuple[str, str, str]] = []

    def add(part: tuple[int, int, int, list[tuple[str, str, str]]]) -> None:
        report.checked += part[0]
        report.ok += part[1]
        report.bytes += part[2]
        problems.extend(part[3])
        if progress:
            progress(report.checked, len(jobs), report.bytes)

    batch = max(1, min(256, len(jobs) // max(1, workers * 8) or 1))
    batches = [jobs[i : i + batch] for i in range(0, len(jobs), batch)]
    # `full` over big shards is CRC32 and pread, which run with the GIL released: threads share
    # them at no start-up cost. `quick` is Python per file: forked children, split evenly up
    # front (files cost about the same). Other mixes (deep, full on small files): a process
    # pool, balancing batches of unequal cost; it costs ~0.1 s to start.
    sizes = [e.size for e in by_path.values()]
    threads = level == "full" and bool(sizes) and sum(sizes) >= len(sizes) * _SMALL_FILE
    if workers > 1 and len(jobs) >= 2 * workers and threads:
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(max_workers=workers) as tpool:
            futures = [tpool.submit(_check_batch, output_dir, b, level, expect, deep_check) for b in batches]
            for fut in cf.as_completed(futures):
                add(fut.result())
    elif workers > 1 and level == "quick" and len(jobs) >= _FORK_MIN_QUICK and hasattr(os, "fork"):
        parts = [(output_dir, jobs[i::workers], level, expect, None) for i in range(workers)]
        for part in _fork_map(_check_batch, parts):
            add(part)
    elif workers > 1 and len(batches) > 1 and len(jobs) >= 4 * workers and level != "quick":
        import concurrent.futures as cf
        import multiprocessing as mp

        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
        with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            futures = [pool.submit(_check_batch, output_dir, b, level, expect, deep_check) for b in batches]
            for fut in cf.as_completed(futures):
                add(fut.result())
    else:
        for b in batches:
            add(_check_batch(output_dir, b, level, expect, deep_check))

    _report_problems(report, problems, {p: e.sample_id for p, e in by_path.items()})
    return _finish(report, output_dir, level, quarantine, check_mode, orphan_min_age, started)


def _report_problems(report: VerifyReport, problems: list[tuple[str, str, str]], ids: dict[str, str]) -> None:
    """Problems (relative path, 'bad' or 'error', reason) into the report; `ids`: path -> sample id."""
    problems.sort()
    for rel, status, reason in problems:
        if status == "bad":
            report.bad.append(BadShard(ids.get(rel), rel, reason))
        else:
            report.errors.append(reason)


def _finish(
    report: VerifyReport,
    output_dir: str,
    level: str,
    quarantine: bool,
    check_mode: bool,
    orphan_min_age: float,
    started: float,
) -> VerifyReport:
    """Quarantine (when asked and nothing failed to read), then time the report."""
    if quarantine and not check_mode and not report.errors:
        _quarantine(output_dir, report, level)
        cutoff = time.time() - orphan_min_age
        for rel in report.orphans:
            full = os.path.join(output_dir, rel)
            try:
                if os.lstat(full).st_mtime <= cutoff:
                    os.unlink(full)
                    report.orphans_removed += 1
            except FileNotFoundError:
                continue
    report.seconds = time.monotonic() - started
    return report


def _quarantine(output_dir: str, report: VerifyReport, level: str) -> None:
    """Move bad shards aside with a reason file; tombstone them and missing ones in the index."""
    tombstones = []
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for bad in report.bad:
        if bad.reason.endswith("(not touched)"):
            if bad.sample_id is not None:
                tombstones.append(tombstone_record(bad.sample_id, bad.reason))
            continue
        src = os.path.join(output_dir, bad.path)
        parts = bad.path.split("/")
        qdir = os.path.join(output_dir, QUARANTINE_DIR, *parts[1:-1])
        os.makedirs(qdir, exist_ok=True)
        dest = os.path.join(qdir, parts[-1])
        n = 1
        while os.path.lexists(dest) or os.path.lexists(dest + REASON_SUFFIX):
            dest = os.path.join(qdir, f"{parts[-1]}.{n}")
            n += 1
        reason = {
            "sample_id": bad.sample_id,
            "path": bad.path,
            "reason": bad.reason,
            "level": level,
            "at": now,
        }
        atomic_write_bytes(dest + REASON_SUFFIX, json.dumps(reason, indent=2).encode("utf-8") + b"\n")
        try:
            os.rename(src, dest)
        except FileNotFoundError:
            os.unlink(dest + REASON_SUFFIX)
            continue
        fsync_dir(os.path.dirname(src))
        fsync_dir(qdir)
        report.quarantined.append(os.path.relpath(dest, output_dir))
        if bad.sample_id is not None:
            tombstones.append(tombstone_record(bad.sample_id, bad.reason))
    tombstones.extend(tombstone_record(sid, "missing on disk") for sid in report.missing)
    append_index(output_dir, tombstones)
