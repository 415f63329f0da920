"""A verification's result (VerifyReport), and what acting on it changes: quarantine and cleanup."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..exitcodes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from ..fsutil import LinkRefused, atomic_write_bytes, open_dir_nofollow, remove_temps
from ..index import append_index, tombstone_record
from ..layout import QUARANTINE_DIR, REASON_SUFFIX
from ..status import STATUS_NAME, read_status, write_json_atomic


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
    and delete writer temps older than orphan_min_age seconds. Then time the report.

    Nothing is moved, written or deleted through a link below the output (fsutil): a folder on
    the way that is one (shards/, a bucket, quarantine/) is an error of the report, naming it."""
    if quarantine and not check_mode and not report.errors:
        try:
            _quarantine(output_dir, report, level)
            cutoff = time.time() - orphan_min_age
            report.orphans_removed += len(remove_temps(output_dir, report.orphans, older_than=cutoff))
        except LinkRefused as e:
            report.errors.append(str(e))
    report.seconds = time.monotonic() - started
    return report


def _quarantine(output_dir: str, report: VerifyReport, level: str) -> None:
    """Move bad shards aside with a reason file; tombstone them and missing ones in the index.

    Every folder a move goes from or to is opened first, without following a link (LinkRefused
    before anything moved), and the moves are renames between those folders' fds."""
    tombstones = []
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    moves: list[tuple[BadShard, str, str]] = []  # (bad shard, its folder, its quarantine folder)
    for bad in report.bad:
        if bad.reason.endswith("(not touched)"):
            if bad.sample_id is not None:
                tombstones.append(tombstone_record(bad.sample_id, bad.reason))
            continue
        parts = bad.path.split("/")
        moves.append((bad, "/".join(parts[:-1]), "/".join([QUARANTINE_DIR, *parts[1:-1]])))
    folders: dict[str, int] = {}
    try:
        for _bad, src_rel, _q_rel in moves:  # the shards' folders first: nothing is created if one is a link
            if src_rel not in folders:
                folders[src_rel] = open_dir_nofollow(output_dir, src_rel)
        for _bad, _src_rel, q_rel in moves:
            if q_rel not in folders:
                folders[q_rel] = open_dir_nofollow(output_dir, q_rel, create=True)
        for bad, src_rel, q_rel in moves:
            sfd, qfd = folders[src_rel], folders[q_rel]
            name = dest = bad.path.rsplit("/", 1)[-1]
            n = 1
            while _lexists(dest, qfd) or _lexists(dest + REASON_SUFFIX, qfd):
                dest = f"{name}.{n}"
                n += 1
            reason = {
                "sample_id": bad.sample_id,
                "path": bad.path,
                "reason": bad.reason,
                "level": level,
                "at": now,
            }
            data = json.dumps(reason, indent=2).encode("utf-8") + b"\n"
            atomic_write_bytes(dest + REASON_SUFFIX, data, dir_fd=qfd)
            try:
                os.rename(name, dest, src_dir_fd=sfd, dst_dir_fd=qfd)
            except FileNotFoundError:
                os.unlink(dest + REASON_SUFFIX, dir_fd=qfd)
                continue
            os.fsync(sfd)
            os.fsync(qfd)
            report.quarantined.append(f"{q_rel}/{dest}")
            if bad.sample_id is not None:
                tombstones.append(tombstone_record(bad.sample_id, bad.reason))
    finally:
        for fd in folders.values():
            os.close(fd)
    tombstones.extend(tombstone_record(sid, "missing on disk") for sid in report.missing)
    append_index(output_dir, tombstones)
    if tombstones:
        _note_in_status(output_dir, len(tombstones), now)


def _note_in_status(output_dir: str, marked: int, at: str) -> None:
    """status.json told that `marked` samples are no longer done, so `hsx status` (and its exit
    status) agrees with the index: done less `marked`, a "done" run now "failed" (a rerun redoes
    them), the message says what happened. No status.json, or one that cannot be used: nothing to
    correct (`hsx status` says why it cannot read it). A live run rewrites the file from its own
    counters within seconds; its next start counts from the index."""
    try:
        status = read_status(output_dir)
    except (OSError, ValueError):
        return
    status["done"] = max(int(status.get("done") or 0) - marked, 0)
    if status.get("state") == "done":
        status["state"] = "failed"
    status["message"] = (
        f"hsx verify --quarantine marked {marked} sample(s) not done at {at}; run hsx extract again to redo them"
    )
    write_json_atomic(os.path.join(output_dir, STATUS_NAME), status)


def _lexists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True
