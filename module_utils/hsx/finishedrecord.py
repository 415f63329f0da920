"""What each host last reported finished, recorded on the control node beside the fleet's assignment.

Stdlib only (the hsx_assignment module on the control node and `hsx fleet-status` both use it).

A takeover of a host that cannot be reached cannot read its output; without a record its finished
buckets were redone whole by the takers. Every reader of the hosts' outputs that knows the fleet's
assignment (`hsx fleet-status`, also from its metrics timer; playbooks/takeover.yml; a rebalance)
records what each host that answered reported finished, so the takeover parks those buckets on
the dead host instead (hsx.fleetplan). The file, `.fleet/finished.json` beside the assignment::

    {"version": 1, "buckets": 1024,
     "hosts": {"node-a": {"finished": "0-40,77", "at": "2026-12-07T17:30:02+00:00", "by": "fleet-status"}}}

Contract:
- `record_path(assignment_path)`: the record's place, beside the assignment file.
- `read_record(path, buckets)`: host -> {"finished": set of buckets, "at": ISO time, "by": reader};
  {} when there is no file (nothing was ever reported: a fleet made before the record, or no reader
  has run yet). A file that cannot be read or believed (a link, not JSON, a bucket count other than
  the assignment's, a host's ranges that do not parse, a time that is not ISO 8601) is a
  FinishedRecordError naming the file and what is wrong - never read as "nothing finished".
- `update_record(path, buckets, reports, by, now)`: each host of `reports` (host -> the buckets its
  own output read finished, now) replaces its entry; the others stay. Under the file's own lock
  (hsx.assignfile.assignment_lock on this path), written atomically (fsutil.atomic_write_bytes:
  temp + rename, no link followed). A record that cannot be read is not overwritten (the error).
  Returns the new record.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

from .assignfile import AssignmentFileError, assignment_lock
from .buckets import AssignError, format_ranges, parse_assign
from .fsutil import LinkRefused, atomic_write_bytes, read_nofollow

FILE_NAME = "finished.json"
VERSION = 1
MAX_FILE_BYTES = 4 << 20


class FinishedRecordError(AssignmentFileError):
    """The record cannot be read, written or believed; the message names it and says what to do."""


def record_path(assignment_path: str) -> str:
    """The record beside the assignment file (its directory: .fleet/ at the default place)."""
    return os.path.join(os.path.dirname(os.path.abspath(assignment_path)), FILE_NAME)


def _fix(path: str) -> str:
    return (f"{path} records what each host last reported finished (the takeover parks those buckets on an "
            "unreachable host); fix it, or remove it (the next hsx fleet-status records the hosts that answer: "
            "until then a takeover of an unreachable host redoes all its buckets)")


def _checked_time(path: str, host: str, value: Any) -> str:
    if not isinstance(value, str):
        raise FinishedRecordError(f"{path}: host {host!r}: 'at' must be an ISO 8601 time, got {value!r}; {_fix(path)}")
    try:
        datetime.datetime.fromisoformat(value)
    except ValueError:
        raise FinishedRecordError(f"{path}: host {host!r}: 'at' {value!r} is not ISO 8601; {_fix(path)}") from None
    return value


def read_record(path: str, buckets: int) -> dict[str, dict[str, Any]]:
    """host -> {finished, at, by}; {} without a file; FinishedRecordError otherwise (module contract)."""
    try:
        raw = read_nofollow(path, MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return {}
    except LinkRefused as e:
        raise FinishedRecordError(f"{e}; {_fix(path)}") from None
    except OSError as e:
        raise FinishedRecordError(f"{path}: cannot read: {e.strerror or e}; {_fix(path)}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise FinishedRecordError(f"{path}: over {MAX_FILE_BYTES} bytes, not a record hsx wrote; {_fix(path)}")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise FinishedRecordError(f"{path}: not valid JSON ({e}); {_fix(path)}") from None
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("hosts"), dict):
        raise FinishedRecordError(f"{path}: not a finished-buckets record (version {VERSION}, 'hosts'); {_fix(path)}")
    if data.get("buckets") != buckets:
        raise FinishedRecordError(
            f"{path}: recorded for {data.get('buckets')!r} buckets, the assignment has {buckets}; {_fix(path)}")
    out: dict[str, dict[str, Any]] = {}
    for host, entry in data["hosts"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("finished"), str):
            raise FinishedRecordError(f"{path}: host {host!r}: an entry needs 'finished' (ranges); {_fix(path)}")
        try:
            finished = set(parse_assign(entry["finished"], buckets)) if entry["finished"].strip() else set()
        except AssignError as e:
            raise FinishedRecordError(f"{path}: host {host!r}: {e}; {_fix(path)}") from None
        out[host] = {"finished": finished, "at": _checked_time(path, host, entry.get("at")),
                     "by": str(entry.get("by", "?"))}
    return out


def encode(record: dict[str, dict[str, Any]], buckets: int) -> bytes:
    """The file's bytes: indented JSON, hosts sorted, a newline at the end."""
    hosts = {h: {"finished": format_ranges(e["finished"]), "at": e["at"], "by": e["by"]}
             for h, e in sorted(record.items())}
    return (json.dumps({"version": VERSION, "buckets": buckets, "hosts": hosts}, indent=2) + "\n").encode("utf-8")


def update_record(
    path: str, buckets: int, reports: dict[str, set[int]], by: str, now: str
) -> dict[str, dict[str, Any]]:
    """Replace the entries of the hosts in `reports`, under the record's lock (module contract)."""
    with assignment_lock(path):
        record = read_record(path, buckets)
        if not reports:
            return record
        for host, finished in reports.items():
            record[host] = {"finished": set(finished), "at": now, "by": by}
        try:
            os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
            atomic_write_bytes(path, encode(record, buckets))
        except OSError as e:
            raise FinishedRecordError(f"{path}: cannot write the record: {e.strerror or e}") from None
        return record
