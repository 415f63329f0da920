#!/usr/bin/python
# Copyright: (c) 2026, hsx maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: hsx_assignment
short_description: The fleet's bucket assignment, kept in one file on the control node
description:
    - A run's samples fall into O(buckets) buckets by a hash of the sample id (module_utils C(hsx.buckets)); each
      host runs the buckets this file assigns it (C(hsx extract --buckets N --assign SPEC)).
    - When O(path) does not exist the assignment is derived from O(hosts) (sorted; contiguous near-equal ranges,
      every bucket on exactly one host) and written there atomically (temp file, rename; no link followed), as
      pretty JSON a person can read (C(buckets), C(created), C(hosts) mapping each host to its ranges).
    - When it exists it is read (never through a link, only a regular file), checked (every bucket on exactly one
      host) and returned as it is; it is never derived again. A host of O(hosts) it does not name fails the task
      (it would run nothing) unless O(rebalance) adds it (below); a host it names that is not in O(hosts) is a
      warning (its buckets stay its own).
    - With O(takeover) a host's unfinished buckets move to O(live_hosts) (module_utils C(hsx.fleetplan)); it keeps
      only those O(finished) names, is recorded in C(retired), C(epoch) grows and C(history) says what moved
      where. A second takeover of the same host changes nothing while what it kept still reads finished
      (O(finished)); kept buckets that no longer do (its disk died) move too.
    - With O(reported) (what every host whose output was read reported finished), a takeover of a host that did not
      answer (not in O(reported)) parks the buckets of its own that the record says it last reported finished; it
      keeps them, no live host redoes them, C(parked) in the file says so, and only the rest move. They move too when
      O(disk_lost) says its disk is gone, or when a takeover runs more than O(park_window) seconds after they were
      parked while it still does not answer. A host that answers keeps what its own output finished, parked no
      more (module_utils C(hsx.fleetplan)).
    - O(reported) is recorded beside O(path) (C(finished.json), what each host last reported finished, checked when
      read, written atomically, module_utils C(hsx.finishedrecord)); C(hsx fleet-status) records there too. A record
      that cannot be read or believed fails the task, naming it (never read as nothing finished); with
      O(reported_by=recovery) it is a warning and nothing is recorded (a recovery never fails on it). Without
      O(takeover) and O(rebalance) it is only recorded (a recovery's read, roles/extraction_job); the assignment is
      read as always.
    - With O(rebalance) hosts of O(hosts) the file does not name are added, taking only buckets no node has
      started (not in O(started)); without it such a host fails the task, so an inventory typo never moves work.
      The retired hosts of O(hosts) whose outputs were read (O(answered)) return the same way (no longer retired;
      the buckets they kept stay theirs), which is how a taken-over node comes back.
    - Runs on the control node (C(delegate_to=localhost), C(run_once), C(become=false)). Check mode writes
      nothing and returns the assignment that would be written.
    - A file at the old default place, C(fleet/assignment.json) beside C(.fleet/) (Ansible read it as an inventory
      source under C(-i DIR)), is moved to O(path) when O(path) is that default place and holds none; it is read and
      checked first (a bad one fails the task, naming it, and stays), its bytes written atomically at O(path), then
      the old file, its empty lock and its directory (when left empty) removed. Check mode reads it where it is.
version_added: "0.2.0"
author:
    - hsx maintainers (!UNKNOWN)
requirements:
    - python >= 3.10 on the managed host
options:
    path:
        description:
            - The assignment file (its directory is made if absent). The roles' default is C(.fleet/assignment.json)
              in the inventory's directory (roles/extraction_job C(extraction_job_assignment_file)).
        type: path
        required: true
    hosts:
        description: The hosts that split the run (the play's hosts).
        type: list
        elements: str
        required: true
    buckets:
        description: The bucket count of a new assignment; an existing file with another count fails the task.
        type: int
        default: 1024
    takeover:
        description: The host whose unfinished buckets move to O(live_hosts) (playbooks/takeover.yml).
        type: str
    live_hosts:
        description: With O(takeover), the hosts that take its buckets (reachable, not retired).
        type: list
        elements: str
        default: []
    finished:
        description:
            - With O(takeover), the buckets (a range list, V('') for none) read finished on that host from its own
              output; a host that could not be reached finished nothing.
        type: str
        default: ""
    rebalance:
        description: Add the hosts of O(hosts) the file does not name, moving to them only unstarted buckets.
        type: bool
        default: false
    started:
        description: With O(rebalance), the buckets (a range list) with any sample done on any node.
        type: str
        default: ""
    reported:
        description:
            - Host -> the buckets (a range list) its own output read finished in this play, for every host whose
              output was read; recorded beside O(path) (not in check mode). With O(takeover), the host taken over
              answered if and only if it is here (its buckets then come from here, not O(finished)); without
              O(reported) it counts as answered with O(finished) and nothing is parked.
        type: dict
    reported_by:
        description:
            - Who read O(reported), kept with each host's entry in the record (C(hsx fleet-status) says it beside
              parked buckets). Default V(takeover) with O(takeover), else V(rebalance).
        type: str
    disk_lost:
        description:
            - With O(takeover), the host's disk is gone (C(hsx takeover HOST --disk-lost)); nothing stays with it,
              parked or finished, its buckets move to O(live_hosts) and are redone.
        type: bool
        default: false
    park_window:
        description:
            - With O(takeover), seconds a host that does not answer keeps the buckets parked on it now; a takeover of
              it after that moves them (playbooks/takeover.yml C(hsx_takeover_park_window)). Kept with them in the
              file (C(window_s)), a later takeover releases them by that window, not by its own, and C(hsx
              fleet-status --prom) exports it (C(hsx_fleet_parked_window_seconds), alert C(HsxParkedPastWindow)).
        type: int
        default: 86400
    answered:
        description:
            - With O(rebalance), the hosts whose outputs were read for O(started). Every host of the file that is not
              retired must be among them, or the task fails (an unread host's buckets cannot be called unstarted).
        type: list
        elements: str
    create:
        description:
            - Whether a missing file may be made. The role passes false when the play runs with C(--limit), since
              an assignment made from part of the fleet would give the rest of it nothing; the task then fails,
              saying so.
        type: bool
        default: true
seealso:
  - module: hsx.recovery.extraction_status_info
    description: Reads which buckets a host has finished or started, for a takeover or a rebalance.
  - module: ansible.builtin.copy
    description: Writes a file too, but without a lock or the assignment's checks.
extends_documentation_fragment:
    - hsx.recovery.attributes
attributes:
    check_mode:
        support: full
        details: Writes nothing; returns the assignment that would be written.
    diff_mode:
        support: full
        details: The assignment file before and after (in check mode, what would be written).
"""

EXAMPLES = r"""
- name: The fleet's assignment
  hsx_assignment:
    path: "{{ inventory_dir }}/.fleet/assignment.json"
    hosts: "{{ ansible_play_hosts_all }}"
  delegate_to: localhost
  run_once: true
  become: false
"""

RETURN = r"""
assignment:
    description: Host -> its buckets as a range list (V(0-511)).
    type: dict
    returned: success
buckets:
    description: The bucket count.
    type: int
    returned: success
created:
    description: When the assignment was made (ISO 8601, UTC).
    type: str
    returned: success
new_hosts:
    description:
        - Hosts of O(hosts) the returned assignment does not name. Empty without O(takeover) (such a host fails the
          task, or O(rebalance) adds it); with O(takeover), the play's hosts waiting for a rebalance, only when nothing
          moved (one among O(live_hosts) fails a takeover that moves buckets; rebalance it in first).
    type: list
    returned: success
gone_hosts:
    description: Hosts the file names that are not in O(hosts).
    type: list
    returned: success
epoch:
    description: How many takeovers and rebalances the assignment has been through.
    type: int
    returned: success
retired:
    description: Hosts taken over (they run nothing they no longer own).
    type: list
    returned: success
moved:
    description:
        - With O(takeover) or O(rebalance), host -> the buckets it gets (a range list); empty when nothing moved. A
          returning host (O(rebalance)) is listed too.
    type: dict
    returned: success
parked:
    description:
        - Host -> the buckets parked on it (a range list), taken over while it did not answer; they are not redone
          unless released (O(disk_lost), O(park_window)).
    type: dict
    returned: success
recorded:
    description:
        - Host -> the buckets (a range list) recorded beside O(path) as what it reported finished, from O(reported);
          in check mode, what would be recorded (nothing is written). Empty without O(reported).
    type: dict
    returned: success
record_path:
    description: Where what the hosts reported finished is recorded (C(finished.json) beside O(path)).
    type: str
    returned: success
migrated_from:
    description: The old place the file was moved from in this run (see the description), or null.
    type: str
    returned: success
"""

import contextlib
import datetime
import os
from collections.abc import Iterator
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.hsx.assignfile import (
    AssignmentFileError,
    assignment_lock,
    check_unchanged,
    encode,
    legacy_path,
    migrate_legacy,
    read_assignment,
    readable_path,
    write_assignment,
)
from ansible.module_utils.hsx.buckets import (
    AssignError,
    derive_assignment,
    format_ranges,
    host_changes,
    parse_assign,
)
from ansible.module_utils.hsx.finishedrecord import read_record, record_path, update_record
from ansible.module_utils.hsx.fleetplan import DEFAULT_PARK_WINDOW_S, plan_rebalance, plan_takeover


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _spec_set(spec: str, buckets: int, what: str) -> set[int]:
    try:
        return set(parse_assign(spec, buckets)) if spec.strip() else set()
    except AssignError as e:
        raise AssignmentFileError(f"{what}: {e}") from None


@contextlib.contextmanager
def _one_at_a_time(path: str, check_mode: bool) -> Iterator[None]:
    """The file's lock around a read -> plan -> write (hsx.assignfile); none in check mode, which writes nothing."""
    if check_mode:
        yield
        return
    with assignment_lock(path):
        yield


def _write(path: str, new: dict[str, Any], read: dict[str, Any] | None) -> None:
    """Write `new` unless the file changed since `read` was read (a writer that took no lock)."""
    check_unchanged(path, read)
    write_assignment(path, new)


def _not_made_here(path: str, hosts: list[str]) -> AssignmentFileError:
    return AssignmentFileError(
        f"{path}: no assignment yet, and this play runs on part of the fleet (--limit): one made from "
        f"{', '.join(hosts) or 'no host'} alone would give every other host nothing. Run the play once "
        "without --limit to make it (with --check first to see it), or set hsx_assignment_file: '' for no "
        "derived split"
    )


def resolve(
    path: str, hosts: list[str], buckets: int, check_mode: bool, create: bool = True, rebalance: bool = False,
    started: str = "", answered: list[str] | None = None, seen: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], bool, list[str], dict[str, str]]:
    """(assignment, changed, warnings, moved): the file's assignment, made from `hosts` when there is
    none (AssignmentFileError then unless `create`); new hosts added by a rebalance when asked. The
    read -> write holds the file's lock (none is made where no file may be made). `seen["before"]`:
    the assignment as read (None: no file), for the diff."""
    if not create and read_assignment(path) is None:
        raise _not_made_here(path, hosts)
    with _one_at_a_time(path, check_mode):
        if seen is not None:
            seen["before"] = read_assignment(path)
        return _resolve(path, hosts, buckets, check_mode, create, rebalance, started, answered)


def _resolve(
    path: str, hosts: list[str], buckets: int, check_mode: bool, create: bool, rebalance: bool,
    started: str, answered: list[str] | None,
) -> tuple[dict[str, Any], bool, list[str], dict[str, str]]:
    recorded = read_assignment(path)
    if recorded is None and not create:
        raise _not_made_here(path, hosts)
    if recorded is None:
        try:
            made = derive_assignment(hosts, buckets)
        except AssignError as e:
            raise AssignmentFileError(f"cannot derive the assignment for {path}: {e}") from None
        assignment = {"buckets": buckets, "created": _now(), "epoch": 0, "hosts": made, "retired": [], "history": []}
        if not check_mode:
            _write(path, assignment, recorded)
        return assignment, True, [], {}
    if recorded["buckets"] != buckets:
        raise AssignmentFileError(
            f"{path}: the assignment has {recorded['buckets']} buckets, the play asks for {buckets} (hsx_buckets): "
            f"the count is fixed once a fleet has an assignment; set hsx_buckets: {recorded['buckets']}, or, only "
            "before any node has started, move the file aside to derive a new one"
        )
    new, gone = host_changes(recorded["hosts"], hosts)
    gone = [h for h in gone if h not in recorded["retired"]]  # a retired host owns nothing to run
    read = set(answered if answered is not None else hosts)
    back = sorted(set(recorded["retired"]) & set(hosts) & read) if rebalance else []  # retired, in the play, read
    if (new or back) and rebalance:
        unread = sorted(set(recorded["hosts"]) - set(recorded["retired"]) - read)
        if unread:
            raise AssignmentFileError(
                f"{path}: cannot rebalance: host(s) {', '.join(unread)} did not answer, so which of their buckets "
                "have started is unknown; bring them back (or take them over: hsx takeover HOST) first"
            )
        try:
            changed_to, gets = plan_rebalance(recorded, new, _spec_set(started, buckets, "started"), _now(), back)
        except AssignError as e:
            raise AssignmentFileError(f"{path}: {e}") from None
        if not check_mode:
            _write(path, changed_to, recorded)
        return changed_to, True, [], {h: format_ranges(b) for h, b in gets.items()}
    if new:
        raise AssignmentFileError(
            f"{path}: host(s) {', '.join(new)} are not in the assignment made {recorded['created']} for "
            f"{', '.join(sorted(recorded['hosts']))}; they would run nothing. Adding hosts moves work, so it is "
            "deliberate: run with -e hsx_rebalance=true (--check first shows what moves), or leave them out of "
            "this play (--limit)"
        )
    warnings = []
    if gone:
        warnings.append(
            f"{path}: host(s) {', '.join(gone)} of the assignment are not in this play (--limit, or gone from the "
            "inventory): their buckets stay theirs and no other host runs them. A host renamed or removed from the "
            "inventory is retired by its old name: hsx takeover HOST (its unfinished buckets move to the live hosts; "
            "a renamed one then joins under its new name with -e hsx_rebalance=true)"
        )
    return recorded, False, warnings, {}


def takeover(
    path: str, host: str, finished: str, live: list[str], check_mode: bool, *,
    reported: dict[str, str] | None = None, disk_lost: bool = False, park_window_s: int | None = None,
    seen: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], bool, dict[str, str]]:
    """(assignment, changed, moved): `host`'s unfinished buckets moved to `live` (hsx.fleetplan); with
    `reported`, a `host` not in it parks what the record says it finished. The read -> write holds the
    file's lock (none is made where there is no file). `seen["before"]`: the assignment as read."""
    if read_assignment(path) is None:
        raise _no_file_to_take_over(path, host)
    with _one_at_a_time(path, check_mode):
        return _takeover(path, host, finished, live, check_mode, reported, disk_lost, park_window_s,
                         seen if seen is not None else {})


def _no_file_to_take_over(path: str, host: str) -> AssignmentFileError:
    return AssignmentFileError(f"{path}: no assignment to take {host} over from (the fleet has no derived split)")


def _takeover(
    path: str, host: str, finished: str, live: list[str], check_mode: bool, reported: dict[str, str] | None,
    disk_lost: bool, park_window_s: int | None, seen: dict[str, Any],
) -> tuple[dict[str, Any], bool, dict[str, str]]:
    recorded = seen["before"] = read_assignment(path)
    if recorded is None:
        raise _no_file_to_take_over(path, host)
    n = recorded["buckets"]
    last = None
    if reported is None:  # no record kept: the host counts as answered with `finished`
        done: set[int] | None = _spec_set(finished, n, f"finished buckets of {host}")
    elif host in reported:
        done = _spec_set(reported[host], n, f"reported finished buckets of {host}")
    else:  # it did not answer: what it last reported, from the record
        done, last = None, read_record(record_path(path), n).get(host)
    try:
        new, moves = plan_takeover(recorded, host, done, live, _now(), recorded=last, disk_lost=disk_lost,
                                   park_window_s=park_window_s)
    except AssignError as e:
        raise AssignmentFileError(f"{path}: {e}") from None
    changed = new is not recorded
    if changed and not check_mode:
        _write(path, new, recorded)
    return new, changed, {h: format_ranges(b) for h, b in moves.items()}


def _record(path: str, buckets: int, reported: dict[str, str] | None, by: str, check_mode: bool) -> dict[str, str]:
    """What the hosts that answered reported finished, recorded beside the assignment (hsx.finishedrecord);
    host -> its buckets as recorded (a range list). Check mode checks them and writes nothing."""
    sets = {h: _spec_set(str(spec or ""), buckets, f"reported finished buckets of {h}")
            for h, spec in (reported or {}).items()}
    if sets and not check_mode:
        update_record(record_path(path), buckets, sets, by, _now())
    return {h: format_ranges(b) for h, b in sorted(sets.items())}


def _diff(path: str, before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, str]:
    """The file's text before and after (--diff)."""
    return {"before_header": path, "after_header": path,
            "before": encode(before).decode("utf-8") if before is not None else "",
            "after": encode(after).decode("utf-8")}


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "hosts": {"type": "list", "elements": "str", "required": True},
            "buckets": {"type": "int", "default": 1024},
            "create": {"type": "bool", "default": True},
            "takeover": {"type": "str"},
            "live_hosts": {"type": "list", "elements": "str", "default": []},
            "finished": {"type": "str", "default": ""},
            "rebalance": {"type": "bool", "default": False},
            "started": {"type": "str", "default": ""},
            "answered": {"type": "list", "elements": "str"},
            "reported": {"type": "dict"},
            "reported_by": {"type": "str"},
            "disk_lost": {"type": "bool", "default": False},
            "park_window": {"type": "int", "default": DEFAULT_PARK_WINDOW_S},
        },
        supports_check_mode=True,
    )
    p = module.params
    path = os.path.abspath(p["path"])
    warnings: list[str] = []
    migrated = None
    try:
        old = legacy_path(path)
        if module.check_mode:
            path = readable_path(path)  # read where it is; nothing is moved
        elif old and os.path.lexists(old) and not os.path.lexists(path):
            with assignment_lock(path):
                migrated = migrate_legacy(path)
        if migrated:
            warnings.append(
                f"moved the fleet's assignment from {migrated} to {path}: Ansible read the old place as an "
                "inventory source (-i DIR); nothing in it changed"
            )
        seen: dict[str, Any] = {}
        if p["takeover"]:
            assignment, changed, moved = takeover(
                path, p["takeover"], p["finished"], p["live_hosts"], module.check_mode, reported=p["reported"],
                disk_lost=p["disk_lost"], park_window_s=p["park_window"], seen=seen,
            )
        else:
            assignment, changed, said, moved = resolve(
                path, list(p["hosts"]), p["buckets"], module.check_mode, p["create"], p["rebalance"], p["started"],
                p["answered"], seen,
            )
            warnings += said
        by = p["reported_by"] or ("takeover" if p["takeover"] else "rebalance")
        try:
            recorded = _record(path, assignment["buckets"], p["reported"], by, module.check_mode)
        except AssignmentFileError as e:
            if by != "recovery":
                raise
            # A recovery only adds to the record: a record it cannot believe must not stop the node coming
            # back (every node's recovery would fail at once: a correlated failure the control node made).
            # It stays as it is, so a takeover, which decides by it, still refuses it naming it.
            recorded = {}
            warnings.append(f"{e}: nothing recorded; the recovery goes on (a takeover refuses this record "
                            "until it is fixed or removed)")
    except AssignmentFileError as e:
        module.fail_json(msg=str(e), path=path)
    for w in warnings:
        module.warn(w)
    new, gone = host_changes(assignment["hosts"], p["hosts"])
    extra = {"diff": _diff(path, seen.get("before"), assignment)} if module._diff and changed else {}
    module.exit_json(
        **extra,
        changed=changed or bool(migrated),
        path=os.path.abspath(p["path"]),
        migrated_from=migrated,
        recorded=recorded,
        record_path=record_path(os.path.abspath(p["path"])),
        assignment=assignment["hosts"],
        buckets=assignment["buckets"],
        created=assignment["created"],
        epoch=assignment.get("epoch", 0),
        retired=assignment.get("retired", []),
        moved=moved,
        parked={h: e["buckets"] for h, e in (assignment.get("parked") or {}).items()},
        new_hosts=new,
        gone_hosts=gone,
    )


if __name__ == "__main__":
    main()
