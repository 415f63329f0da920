"""The index log: index.jsonl, one line per completed sample, appended and replayed.

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

import io
import json
import operator
import os
import struct
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .fsutil import open_nofollow, read_nofollow
from .layout import INDEX_NAME, SHARD_RELPATH_RE, shard_relpath


@dataclass(slots=True)
class IndexEntry:
    """One completed sample: where its shard is (relative to the output root) and what it holds."""

    sample_id: str
    path: str
    size: int
    checksum: str  # "crc32:xxxxxxxx" of the whole file
    num_tokens: int
    fingerprint: str | None = None  # run.json's (manifest.manifest_fingerprint); None: an older line


def checksum_string(crc: int) -> str:
    return f"crc32:{crc & 0xFFFFFFFF:08x}"


def encode_index_line(record: dict[str, Any]) -> bytes:
    """`<compact json>\\t<crc32 of the json>\\n`: a torn or damaged line fails its own CRC."""
    body = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    crc = zlib.crc32(body.encode("ascii")) & 0xFFFFFFFF
    return f"{body}\t{crc:08x}\n".encode("ascii")


def decode_index_line(line: bytes) -> dict[str, Any] | None:
    """The record of one index line, or None when the line is torn or damaged."""
    return parse_index_line(line)[0]


def parse_index_line(line: bytes) -> tuple[dict[str, Any] | None, str]:
    """(the record of one index line, "") or (None, why the line is no record): torn, damaged,
    not JSON, nested too deeply for the parser, or not a JSON object. Never raises."""
    if not line.endswith(b"\n"):
        return None, "no newline at its end (torn)"
    body, sep, crc = line[:-1].rpartition(b"\t")
    if not sep or len(crc) != 8:
        return None, "no CRC at its end (damaged)"
    try:
        if zlib.crc32(body) & 0xFFFFFFFF != int(crc, 16):
            return None, "CRC32 mismatch (damaged)"
    except ValueError:
        return None, "CRC is not hexadecimal (damaged)"
    try:
        record = json.loads(body)
    except RecursionError:  # a valid CRC proves nothing: "[[[[..." exhausts the parser's recursion
        return None, "JSON nested too deeply"
    except ValueError as e:  # also bad UTF-8 and integers of too many digits
        return None, f"not JSON ({str(e)[:80]})"
    if not isinstance(record, dict):
        return None, f"not a JSON object (a {type(record).__name__})"
    return record, ""


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
    The joined parse stands for the lines' own only when it gives one value per line (a body
    such as `{..},{..}` would give two and shift every later line): else, line by line.
    """
    crc32 = zlib.crc32
    bodies: list[bytes | None] = [line[:-10] for line in lines]
    for i, (line, body) in enumerate(zip(lines, bodies, strict=True)):
        if line[-10:] != b"\t%08x\n" % crc32(body):
            bodies[i] = _line_body(line)
    good = [b for b in bodies if b is not None]
    try:
        values = json.loads(b"[" + b",".join(good) + b"]")
    except (ValueError, RecursionError):  # a line with a valid CRC but bad JSON: line by line
        return [decode_index_line(line) for line in lines]
    if len(values) != len(good):
        return [decode_index_line(line) for line in lines]
    parsed = iter(values)
    out: list[dict[str, Any] | None] = []
    for b in bodies:
        record = next(parsed) if b is not None else None
        out.append(record if isinstance(record, dict) else None)
    return out


@dataclass
class IndexState:
    """An index read back: live entries plus how many lines were unreadable.

    Every line gets one verdict: applied (an entry or a tombstone: `records`), or a problem
    (`problems`: line number from 1 and the reason), which is the torn tail when it is the last
    line and a bad line otherwise. records + len(problems) == the number of lines.
    """

    entries: dict[str, IndexEntry] = field(default_factory=dict)
    bad_lines: int = 0
    torn_tail: bool = False
    records: int = 0
    problems: list[tuple[int, str]] = field(default_factory=list)


def read_index(output_dir: str) -> IndexState:
    """Replay index.jsonl: later lines win; tombstones drop a sample; damaged lines are skipped.

    A missing index is an empty one (a run that has not finished a sample yet).
    """
    return replay_index(read_index_lines(output_dir))


def read_index_lines(output_dir: str) -> list[bytes]:
    """index.jsonl's lines as stored (none when it does not exist). Never through a link, never
    blocking on a FIFO: fsutil.LinkRefused (an OSError naming the file) when it is not a
    regular file."""
    try:
        return io.BytesIO(read_nofollow(os.path.join(output_dir, INDEX_NAME))).readlines()
    except FileNotFoundError:
        return []


def replay_index(lines: list[bytes]) -> IndexState:
    """read_index on lines already read. Never raises: a line is data, not truth."""
    state = IndexState()
    last = len(lines) - 1
    for n, record in enumerate(_decode_index_lines(lines)):
        why = _apply(state, record) if record is not None else parse_index_line(lines[n])[1]
        if not why:
            state.records += 1
            continue
        state.problems.append((n + 1, why))
        if n == last and record is None:
            state.torn_tail = True
        else:
            state.bad_lines += 1
    return state


def _apply(state: IndexState, record: dict[str, Any]) -> str:
    """One decoded record onto the state: "" when applied, else why it is a bad line."""
    sample_id = record.get("id")
    if not isinstance(sample_id, str) or not sample_id:
        return "no sample id"
    if record.get("removed"):
        state.entries.pop(sample_id, None)
        return ""
    fingerprint = record.get(FINGERPRINT_KEY)
    if fingerprint is not None and not isinstance(fingerprint, str):
        return f"{FINGERPRINT_KEY} is not a string"
    try:
        state.entries[sample_id] = IndexEntry(
            sample_id,
            str(record["path"]),
            int(record["size"]),
            str(record["checksum"]),
            int(record["num_tokens"]),
            fingerprint,
        )
    except KeyError as e:
        return f"entry lacks {e.args[0]!r}"
    except (TypeError, ValueError, OverflowError, RecursionError) as e:  # inf, nan, "x", [[...]]
        return f"entry field does not convert ({type(e).__name__})"
    return ""


# An entry's run.json fingerprint (manifest.manifest_fingerprint); lines written before it have none.
FINGERPRINT_KEY = "run_fp"

OUTSIDE_SHARDS = "index entry points outside shards/ (not touched)"


def entry_problems(entries: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Sample id -> why its live entry (sample id, path) must not count as done, for the entries
    that must not: the one rule verify and resume share. A valid line CRC proves that a line is
    whole, not that our writer wrote it for that sample, so an entry counts only at its sample's
    own shard path (layout.shard_relpath): a path outside shards/ (absolute, `..`) is never
    touched; two entries naming one shard are both reported, with their ids (one of them lost
    its shard, or was never ours); any other path is not that sample's shard. Every reason ends
    in "(not touched)": quarantine tombstones such an entry and moves no file.
    """
    problems: dict[str, str] = {}
    by_path: dict[str, list[str]] = {}
    for sid, path in entries:
        if not SHARD_RELPATH_RE.fullmatch(path) or ".." in path.split("/"):
            problems[sid] = OUTSIDE_SHARDS
        else:
            by_path.setdefault(path, []).append(sid)
    for path, sids in by_path.items():
        if len(sids) > 1:
            named = sorted(sids)
            more = f" and {len(named) - 8} more" if len(named) > 8 else ""
            why = f"index entries {', '.join(map(repr, named[:8]))}{more} name the same shard (not touched)"
            problems.update(dict.fromkeys(sids, why))
            continue
        sid = sids[0]
        try:
            own = shard_relpath(sid)
        except ValueError:
            own = None
        if path != own:
            problems[sid] = f"index entry is not at sample {sid!r}'s own shard path {own} (not touched)"
    return problems


def load_index(output_dir: str) -> dict[str, IndexEntry]:
    """sample_id -> IndexEntry of every completed (not quarantined) sample."""
    return read_index(output_dir).entries


def index_record(entry: IndexEntry) -> dict[str, Any]:
    record = {
        "id": entry.sample_id,
        "path": entry.path,
        "size": entry.size,
        "checksum": entry.checksum,
        "num_tokens": entry.num_tokens,
    }
    if entry.fingerprint is not None:
        record[FINGERPRINT_KEY] = entry.fingerprint
    return record


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
    """The index opened for appends (created if absent); a long-lived writer keeps it open.
    Never through a link (fsutil.LinkRefused: root would append to whatever it points at)."""
    return open_nofollow(os.path.join(output_dir, INDEX_NAME), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


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


# --- the fast path for an index of only lines as encode_index_line writes entries --------------
_LINE_BODY = operator.itemgetter(slice(None, -10))
_LINE_CRC = operator.itemgetter(slice(-9, -1))
_LINE_TAB = operator.itemgetter(slice(-10, -9))
_ROW = operator.itemgetter("id", "path", "size", "checksum", "num_tokens")  # IndexEntry's field order
_ROW_FP = operator.itemgetter("id", "path", "size", "checksum", "num_tokens", FINGERPRINT_KEY)

# An index entry as a tuple: (sample_id, path, size, checksum, num_tokens[, fingerprint]),
# IndexEntry's field order (IndexEntry(*row) rebuilds it).
IndexRow = tuple[Any, ...]


def index_rows(lines: list[bytes]) -> dict[str, IndexRow] | None:
    """replay_index's entries as rows, for an index of only lines as encode_index_line writes
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
        if len(records) != len(lines):  # a body such as `{..},{..}`: two values from one line
            return None
        keys = set(map(len, records))  # 5: lines before the fingerprint, 6: with it
        if keys not in ({5}, {6}):  # other keys too (one may be "removed"), or old and new mixed
            return None
        rows = list(map(_ROW if keys == {5} else _ROW_FP, records))  # KeyError: another record
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    columns = list(zip(*rows, strict=True))
    ids, paths, sizes, checksums, tokens = columns[:5]
    strings = ids + paths + checksums + (columns[5] if len(columns) > 5 else ())
    if set(map(type, strings)) != {str} or set(map(type, sizes + tokens)) != {int}:
        return None  # read_index would convert these (or count the line bad)
    if "" in ids:
        return None  # read_index counts the line bad
    return dict(zip(ids, rows, strict=True))  # later lines win
