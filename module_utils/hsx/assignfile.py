"""The fleet's assignment file on the control node: read (checked), written (atomically).

Stdlib only (Ansible modules on the control node and `hsx fleet-status` both use it: one reader).

The file is pretty JSON a person can read::

    {"buckets": 1024, "created": "...", "epoch": 1,
     "hosts": {"node-a": "0-511,768-1023", "node-b": "", "node-c": "512-767"},
     "retired": ["node-b"],
     "history": [{"epoch": 1, "at": "...", "action": "takeover", "host": "node-b",
                  "kept": "", "moved": {"node-a": "768-1023", "node-c": "512-767"}}]}

(`parked`, only while a retired host that did not answer keeps buckets it last reported finished:
host -> {buckets, since, reported_at, reported_by, window_s}; hsx.fleetplan.)

Contract:
- `read_assignment(path)`: the checked dict (every bucket on exactly one host; a host may own ""),
  with `epoch` (0), `retired` ([]) and `history` ([]) filled in for a file made before them; None
  when there is no file. Never through a link, only a regular file; anything else is an
  AssignmentFileError naming the file and saying what to do.
- `write_assignment(path, data)`: checks, then temp file + rename (no link followed); the
  directory is made if absent.
- `assignment_lock(path)`: an exclusive flock on the sibling PATH.lock (made if absent, never
  through a link, only a regular file), held around a read -> plan -> write so two plays that
  change the file (takeovers, rebalances) take turns; it waits up to `wait_s`, then an
  AssignmentFileError says another play holds it.
- `check_unchanged(path, read)`: under the lock, before writing: AssignmentFileError (rerun) when
  the file is not what was read (`read` None: there was no file) - its epoch or hosts changed,
  by a writer that took no lock (a hand edit, an older hsx).

Its default place (`default_path(inventory_dir)`) is `<inventory dir>/.fleet/assignment.json`: kept
with the inventory, where Ansible never reads it as an inventory source (under `-i DIR` the loader
parses every file below DIR but names starting with "." - always - and the INVENTORY_IGNORE_EXTS /
INVENTORY_IGNORE_PATTERNS settings, which leave .json and .lock files in). The old default,
`<inventory dir>/fleet/assignment.json` (`legacy_path`), was parsed so (warnings, a bogus group):
- `readable_path(path)`: where a file at the default place is read from: `path`, or the old place
  while `path` has none and the old one has (check mode, hsx fleet-status: nothing moved).
- `migrate_legacy(path)`, under assignment_lock(path): the file at the old place moved to `path`
  when `path` has none - read and checked first (AssignmentFileError naming it, nothing moved), its
  very bytes written atomically at `path`, then the old file, its lock (an empty regular file) and
  its directory (if then empty) removed. Returns the old path it moved, else None.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import time
from collections.abc import Iterator
from typing import Any

from .buckets import AssignError, check_assignment, format_ranges, parse_assign
from .fsutil import LinkRefused, atomic_write_bytes, open_nofollow, read_nofollow

LOCK_SUFFIX = ".lock"
DEFAULT_DIR, LEGACY_DIR, FILE_NAME = ".fleet", "fleet", "assignment.json"  # roles/extraction_job's default: the same
LOCK_WAIT_S = 120.0  # a takeover's read -> write takes well under a second
MAX_FILE_BYTES = 4 << 20  # a thousand hosts' ranges and a long history are well under this
ASIDE = "fix it, or move it aside to derive a new assignment (only before any node has started: it reassigns buckets)"


class AssignmentFileError(Exception):
    """The file cannot be read, written or believed; the message names it and says what to do."""


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _read_raw(path: str) -> bytes | None:
    try:
        return read_nofollow(path, MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except LinkRefused as e:
        raise AssignmentFileError(f"{e}; put the assignment file itself there") from None
    except OSError as e:
        raise AssignmentFileError(f"{path}: cannot read the assignment: {e.strerror or e}") from None


def read_assignment(path: str) -> dict[str, Any] | None:
    """The file's {buckets, created, epoch, hosts, retired, history}, checked; None when there is none."""
    raw = _read_raw(path)
    return None if raw is None else _parse(path, raw)


def _parse(path: str, raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_FILE_BYTES:
        raise AssignmentFileError(f"{path}: over {MAX_FILE_BYTES} bytes, not an assignment hsx wrote; {ASIDE}")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise AssignmentFileError(f"{path}: not valid JSON ({e}); {ASIDE}") from None
    hosts = data.get("hosts") if isinstance(data, dict) else None
    if not isinstance(hosts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in hosts.items()):
        raise AssignmentFileError(f"{path}: not an assignment (an object with 'hosts': host -> ranges); {ASIDE}")
    try:
        check_assignment(hosts, data.get("buckets"), path)
    except AssignError as e:
        raise AssignmentFileError(f"{e}; {ASIDE}") from None
    epoch, retired, history = data.get("epoch", 0), data.get("retired", []), data.get("history", [])
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise AssignmentFileError(f"{path}: 'epoch' must be a whole number >= 0, got {epoch!r}; {ASIDE}")
    if not _strings(retired) or not set(retired) <= hosts.keys():
        raise AssignmentFileError(f"{path}: 'retired' must list hosts of 'hosts', got {retired!r}; {ASIDE}")
    if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
        raise AssignmentFileError(f"{path}: 'history' must be a list of objects; {ASIDE}")
    out = {
        "buckets": data["buckets"],
        "created": str(data.get("created", "?")),
        "epoch": epoch,
        "hosts": hosts,
        "retired": list(retired),
        "history": history,
    }
    if "parked" in data:
        out["parked"] = _checked_parked(path, data["parked"], out)
    return out


def _checked_parked(path: str, parked: Any, assignment: dict[str, Any]) -> dict[str, Any]:
    """`parked` (host -> {buckets, since, reported_at, reported_by, window_s where given}): a retired host's
    own buckets only."""
    if not isinstance(parked, dict):
        raise AssignmentFileError(f"{path}: 'parked' must map hosts to their parked buckets; {ASIDE}")
    n = assignment["buckets"]
    for host, entry in parked.items():
        if host not in assignment["retired"]:
            raise AssignmentFileError(f"{path}: 'parked' names {host!r}, which is not retired; {ASIDE}")
        keys = ("buckets", "since", "reported_at", "reported_by")
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) for k in keys):
            raise AssignmentFileError(f"{path}: 'parked' {host!r} needs {', '.join(keys)} (strings); {ASIDE}")
        window = entry.get("window_s", 0)
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise AssignmentFileError(
                f"{path}: 'parked' {host!r}: 'window_s' must be whole seconds >= 0, got {window!r}; {ASIDE}")
        try:
            mine = parse_assign(assignment["hosts"][host], n) if assignment["hosts"][host] else frozenset()
            bad = set(parse_assign(entry["buckets"], n)) - mine if entry["buckets"] else set()
        except AssignError as e:
            raise AssignmentFileError(f"{path}: 'parked' {host!r}: {e}; {ASIDE}") from None
        if bad:
            raise AssignmentFileError(
                f"{path}: 'parked' {host!r} names bucket(s) {format_ranges(bad)} it does not own; {ASIDE}")
    return parked


def default_path(inventory_dir: str) -> str:
    """The file's default place for an inventory directory (the module's contract)."""
    return os.path.join(inventory_dir, DEFAULT_DIR, FILE_NAME)


def legacy_path(path: str) -> str | None:
    """The old default place of a file at the default place (DIR/.fleet/assignment.json ->
    DIR/fleet/assignment.json); None for a file anywhere else (a place the operator chose)."""
    directory, name = os.path.split(path)
    if name != FILE_NAME or os.path.basename(directory) != DEFAULT_DIR:
        return None
    return os.path.join(os.path.dirname(directory), LEGACY_DIR, FILE_NAME)


def readable_path(path: str) -> str:
    """`path`, or the old place while only it has a file (read there; see the module's contract)."""
    legacy = legacy_path(path)
    if legacy and not os.path.lexists(path) and os.path.lexists(legacy):
        return legacy
    return path


def migrate_legacy(path: str) -> str | None:
    """Move the file at the old default place to `path` (see the module's contract); hold
    assignment_lock(path) around it."""
    legacy = legacy_path(path)
    if legacy is None or os.path.lexists(path):
        return None
    raw = _read_raw(legacy)
    if raw is None:
        return None
    _parse(legacy, raw)  # checked: a file that is not an assignment stays where it is, named
    try:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        atomic_write_bytes(path, raw)
    except OSError as e:
        raise AssignmentFileError(f"{path}: cannot move the assignment here from {legacy}: {e.strerror or e}") from None
    os.unlink(legacy)
    lock = legacy + LOCK_SUFFIX
    try:
        st = os.lstat(lock)
        if stat.S_ISREG(st.st_mode) and st.st_size == 0:
            os.unlink(lock)
        os.rmdir(os.path.dirname(legacy))  # only if nothing else is in it
    except OSError:
        pass
    return legacy


def encode(assignment: dict[str, Any]) -> bytes:
    """The file's bytes: indented JSON, keys in a fixed order, a newline at the end."""
    return (json.dumps(assignment, indent=2) + "\n").encode("utf-8")


def write_assignment(path: str, assignment: dict[str, Any]) -> None:
    """Check `assignment`, then replace the file atomically (AssignmentFileError on failure)."""
    try:
        check_assignment(assignment["hosts"], assignment["buckets"], path)
    except AssignError as e:
        raise AssignmentFileError(f"refusing to write {path}: {e}") from None
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
        atomic_write_bytes(path, encode(assignment))
    except OSError as e:
        raise AssignmentFileError(f"{path}: cannot write the assignment: {e.strerror or e}") from None


@contextlib.contextmanager
def assignment_lock(path: str, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Hold the exclusive lock of the assignment at `path` (see the module's contract)."""
    lock = path + LOCK_SUFFIX
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
        fd = open_nofollow(lock, os.O_RDWR | os.O_CREAT, 0o644)  # never a link, never a FIFO's wait
    except LinkRefused as e:
        raise AssignmentFileError(
            f"{lock} is {e.found}: refusing to lock through it; remove it (hsx makes it as a plain file)"
        ) from None
    except OSError as e:
        raise AssignmentFileError(f"{lock}: cannot open the assignment's lock: {e.strerror or e}") from None
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise AssignmentFileError(
                        f"{lock}: another play has held the assignment for over {wait_s:.0f}s (a takeover or "
                        "rebalance); nothing was changed: let it finish, then rerun"
                    ) from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # releases the lock


def check_unchanged(path: str, read: dict[str, Any] | None) -> None:
    """AssignmentFileError unless the file is still what `read` was (see the module's contract)."""
    now = read_assignment(path)
    if read is None and now is None:
        return
    if read is not None and now is not None and (now["epoch"], now["hosts"]) == (read["epoch"], read["hosts"]):
        return
    then_epoch = "no file" if read is None else read["epoch"]
    now_epoch = "no file" if now is None else now["epoch"]
    raise AssignmentFileError(
        f"{path} changed since this play read it (epoch {then_epoch} then, {now_epoch} now): another takeover, "
        "rebalance or edit came in between; nothing was written: rerun (--check first shows the plan against "
        "the file as it is now)"
    )
