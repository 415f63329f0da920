"""A verification's result (VerifyReport), and what acting on it changes: quarantine and cleanup."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..exitcodes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from ..fsutil import atomic_write_bytes, fsync_dir
from ..index import append_index, tombstone_record
from ..layout import QUARANTINE_DIR, REASON_SUFFIX


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
            return EXIT_USAGE
        return EXIT_FAILED if self.bad or self.missing else EXIT_OK

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


def add_problems(report: VerifyReport, problems: list[tuple[str, str, str]], ids: dict[str, str]) -> None:
    """Problems (relative path, 'bad' or 'error', reason) into the report; `ids`: path -> sample id."""
    problems.sort()
    for rel, status, reason in problems:
        if status == "bad":
            report.bad.append(BadShard(ids.get(rel), rel, reason))
        else:
            report.errors.append(reason)


def finish(
    report: VerifyReport,
    output_dir: str,
    level: str,
    quarantine: bool,
    check_mode: bool,
    orphan_min_age: float,
    started: float,
) -> VerifyReport:
    """With `quarantine`, not in check mode and nothing failed to read: quarantine the bad shards
    and delete writer temps older than orphan_min_age seconds. Then time the report."""
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
