"""The zip container of a torch.save file, read with positional reads and every record bounded.

torch.save writes a stored (uncompressed) zip without an archive comment. read_zip_records
accepts exactly that: every record must lie inside the file, where the central directory says,
named the same in its local header, and clear of the next record; anything else is ShardBad.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass

from .errors import ShardBad

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
# A central-directory entry: its fixed part plus name, extra field and comment. torch.save names a
# record `<file stem>/<path>` (a stem is at most 255 bytes) and adds at most a zip64 extra field,
# so 1 KiB more than the fixed part is plenty; with _MAX_RECORDS it bounds the one read of the
# directory (4.4 MB), whatever size a damaged or hostile end record declares.
_MAX_CD_ENTRY = _CDIR.size + 1024
# Files up to this size are read whole, in one read, and checked from memory. Every module reads it
# as ziprecords.SMALL_FILE when called, so one assignment moves the line for the whole verifier.
SMALL_FILE = 1 << 20


@dataclass(slots=True)
class ZipRecord:
    name: str
    header_offset: int
    data_offset: int
    size: int
    crc: int
    raw_name: bytes = b""
    crc_at: int = -1  # file offset of this record's CRC field in the central directory


class ShardReader:
    """Positional reads on an open file; small files are read once and served from memory."""

    def __init__(self, fd: int, size: int, whole: bytes | None = None):
        self.fd, self.size = fd, size
        if whole is None and size <= SMALL_FILE:
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


def read_zip_records(reader: ShardReader) -> tuple[list[ZipRecord], int]:
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
    if cd_size > n_total * _MAX_CD_ENTRY:
        raise ShardBad(
            f"central directory of {cd_size} bytes exceeds what {n_total} record(s) can fill "
            f"({n_total * _MAX_CD_ENTRY} bytes at most)"
        )
    cd = reader.read(cd_offset, cd_size)  # bounded by the file's size and by the check above
    records: list[ZipRecord] = []
    names: set[str] = set()
    pos = 0
    for _record in range(n_total):
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


# The archive version torch.load accepts (caffe2's PyTorchStreamReader): the `.data/version`
# record when there is one, else `version`, parsed by std::stoull - leading C whitespace, an
# optional sign, decimal digits, anything after them ignored; a minus wraps modulo 2**64 - and
# within kMinSupportedFileFormatVersion..kMaxSupportedFileFormatVersion (1..10 in caffe2/serialize/versions.h, torch 2.13).
TORCH_FILE_VERSIONS = range(1, 11)
_VERSION_RE = re.compile(rb"[ \t\n\v\f\r]*([+-]?)([0-9]+)")
_MAX_VERSION_RECORD = 64  # torch.save writes b"3\n"; a longer record is not a file it wrote


def check_torch_version(reader: ShardReader, by_name: dict[str, ZipRecord], prefix: str) -> None:
    """ShardBad unless the version record torch reads parses as torch parses it, to a version it
    loads: `quick` and `full` pass only files whose version `deep` (torch.load) accepts."""
    rec = by_name.get(f"{prefix}/.data/version") or by_name.get(f"{prefix}/version")
    if rec is None:
        raise ShardBad("no version record")
    name = rec.name[len(prefix) + 1 :]
    if rec.size > _MAX_VERSION_RECORD:
        raise ShardBad(f"{name} record of {rec.size} bytes: not a torch.save file")
    text = reader.read(rec.data_offset, rec.size)
    m = _VERSION_RE.match(text)
    if m is None:
        raise ShardBad(f"{name} record {text[:16]!r} is not a number: torch.load cannot parse it")
    digits = m[2].lstrip(b"0") or b"0"
    value = int(digits) if len(digits) <= 20 else 1 << 64  # no int() of a 60-byte number
    if value >= 1 << 64:
        raise ShardBad(f"{name} record {text[:16]!r} is out of range: torch.load cannot parse it")
    if m[1] == b"-":
        value = -value % (1 << 64)
    if value not in TORCH_FILE_VERSIONS:
        raise ShardBad(
            f"{name} record says format version {value}: torch.load reads "
            f"{TORCH_FILE_VERSIONS.start} to {TORCH_FILE_VERSIONS.stop - 1}"
        )
