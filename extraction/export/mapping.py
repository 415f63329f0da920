"""What an export view records besides its links: DEST/export.json and DEST/mapping.jsonl.

export.json says what the view is (layout, link mode, group size, the run it belongs to) and is
written once, when the view is made. mapping.jsonl is append-only, one line per number given
(`data_i` -> sample id, source output, shard path); a later line for the same number re-points
it (the sample's output moved, or another node's copy is used) and never renames it.

Why plain JSON lines (no per-line CRC as in index.jsonl): the mapping is for people and tools
(`jq 'select(.i == 42)' mapping.jsonl`); the only damage our protocol can cause is a torn last
line, which lacks its newline or fails to parse, and is dropped (and cut off) on the next run.

Neither is read or written through a link put at its name (hsx.fsutil): one is refused, naming it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hsx.fsutil import LinkRefused, atomic_write_bytes, nofollow_opener, open_nofollow
from hsx.manifest import RunManifest

VIEW_FORMAT = "hsx-export-view"
VIEW_VERSION = 1
META_NAME = "export.json"
MAPPING_NAME = "mapping.jsonl"


class ExportError(Exception):
    """A usage or I/O problem: nothing was changed in DEST (exit 2)."""


@dataclass
class MappingRecord:
    i: int
    sample_id: str
    output: str  # realpath of the source output directory
    shard: str  # shard path relative to output

    def to_json(self) -> dict[str, Any]:
        return {"i": self.i, "id": self.sample_id, "output": self.output, "shard": self.shard}

    @property
    def target(self) -> str:
        return os.path.join(self.output, self.shard)


def read_meta(dest: str) -> dict[str, Any] | None:
    """export.json, or None when DEST has none; ExportError when it is not ours or unreadable."""
    path = os.path.join(dest, META_NAME)
    try:
        with open(path, encoding="utf-8", opener=nofollow_opener) as f:
            meta = json.load(f)
    except FileNotFoundError:
        return None
    except LinkRefused as e:
        raise ExportError(str(e)) from None
    except RecursionError:
        raise ExportError(f"{path}: unreadable export view metadata: JSON nested too deeply") from None
    except (OSError, ValueError) as e:
        raise ExportError(f"{path}: unreadable export view metadata: {e}") from None
    if not isinstance(meta, dict):
        raise ExportError(f"{path}: not an hsx export view (not a JSON object)")
    if meta.get("format") != VIEW_FORMAT:
        raise ExportError(f"{path}: not an hsx export view (format {str(meta.get('format'))[:60]!r})")
    version = meta.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version > VIEW_VERSION:
        raise ExportError(f"{path}: export view version {str(version)[:20]!r} is newer than this code")
    # What the export uses as it is: refused here rather than trusted there.
    group_size = meta.get("group_size")
    problems = [
        *([] if isinstance(meta.get("layout"), str) else ["layout is not a string"]),
        *([] if meta.get("link") in ("symlink", "hardlink") else ["link is not symlink or hardlink"]),
        *(
            []
            if isinstance(group_size, int) and not isinstance(group_size, bool) and group_size >= 1
            else ["group_size is not a positive integer"]
        ),
        *([] if isinstance(meta.get("run", {}), dict) else ["run is not an object"]),
    ]
    if problems:
        raise ExportError(f"{path}: damaged export view metadata: {'; '.join(problems)}")
    return meta


def write_meta(dest: str, layout: str, link: str, group_size: int, run: RunManifest) -> dict[str, Any]:
    """Write a new view's export.json (atomic rename); returns what it wrote."""
    meta = {
        "format": VIEW_FORMAT,
        "version": VIEW_VERSION,
        "layout": layout,
        "link": link,
        "group_size": group_size,
        "run": {k: v for k, v in run.to_dict().items() if k not in ("extra", "created_at")},
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    atomic_write_bytes(os.path.join(dest, META_NAME), json.dumps(meta, indent=2).encode() + b"\n")
    return meta


def read_mapping(dest: str) -> tuple[dict[int, MappingRecord], bool]:
    """number -> record (later lines win) and whether the last line was torn.

    Raises ExportError when a complete line is damaged or a number changes its sample: that
    mapping cannot be trusted to keep numbering stable, and guessing would renumber data.
    """
    path = os.path.join(dest, MAPPING_NAME)
    try:
        with open(path, "rb", opener=nofollow_opener) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return {}, False
    except LinkRefused as e:
        raise ExportError(str(e)) from None
    records: dict[int, MappingRecord] = {}
    torn = False
    for n, line in enumerate(lines, 1):
        try:
            if not line.endswith(b"\n"):
                raise ValueError("no newline")
            rec = _parse_mapping_line(line)
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            if n == len(lines):
                torn = True
                break
            raise ExportError(f"{path}:{n}: damaged mapping line ({e}); refusing to renumber") from None
        old = records.get(rec.i)
        if old is not None and old.sample_id != rec.sample_id:
            raise ExportError(
                f"{path}:{n}: data_{rec.i} was {old.sample_id!r}, this line says {rec.sample_id!r}"
            )
        records[rec.i] = rec
    by_id: dict[str, int] = {}
    for rec in records.values():
        if by_id.setdefault(rec.sample_id, rec.i) != rec.i:
            raise ExportError(
                f"{path}: sample {rec.sample_id!r} has two numbers ({by_id[rec.sample_id]}, {rec.i})"
            )
    return records, torn


def _parse_mapping_line(line: bytes) -> MappingRecord:
    """One complete line -> its record, the types _mapping_line writes; ValueError/KeyError/
    TypeError/RecursionError (json: nested too deeply) otherwise. Nothing is coerced: a line that
    is not what we wrote is damaged, not read as something close to it."""
    d = json.loads(line)
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    i = d["i"]
    if isinstance(i, bool) or not isinstance(i, int) or i < 0:
        raise ValueError("bad number")
    fields = (d["id"], d["output"], d["shard"])
    if not all(isinstance(v, str) for v in fields):
        raise ValueError("id, output and shard must be strings")
    return MappingRecord(i, *fields)


def _mapping_line(rec: MappingRecord) -> bytes:
    return json.dumps(rec.to_json(), sort_keys=True, ensure_ascii=True).encode("ascii") + b"\n"


def append_mapping(dest: str, recs: Sequence[MappingRecord]) -> None:
    """Append `recs` to mapping.jsonl and fsync it: done before any of their links is made."""
    data = b"".join(_mapping_line(r) for r in recs)
    if not data:
        return
    fd = open_nofollow(os.path.join(dest, MAPPING_NAME), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def rewrite_mapping(dest: str, records: dict[int, MappingRecord]) -> None:
    """Replace a mapping whose last line was torn by its good lines (atomic rename)."""
    data = b"".join(_mapping_line(records[i]) for i in sorted(records))
    atomic_write_bytes(os.path.join(dest, MAPPING_NAME), data)
