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
      (O(finished)); kept buckets that no longer do (its disk died, it cannot be reached) move too.
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
extends_documentation_fragment:
    - hsx.recovery.attributes
attributes:
    check_mode:
        support: full
        details: Writes nothing; returns the assignment that would be written.
    diff_mode:
        support: none
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
from ansible.module_utils.hsx.fleetplan import plan_rebalance, plan_takeover


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
    started: str = "", answered: list[str] | None = None,
) -> tuple[dict[str, Any], bool, list[str], dict[str, str]]:
    """(assignment, changed, warnings, moved): the file's assignment, made from `hosts` when there is
    none (AssignmentFileError then unless `create`); new hosts added by a rebalance when asked. The
    read -> write holds the file's lock (none is made where no file may be made)."""
    if not create and read_assignment(path) is None:
        raise _not_made_here(path, hosts)
    with _one_at_a_time(path, check_mode):
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
    path: str, host: str, finished: str, live: list[str], check_mode: bool
) -> tuple[dict[str, Any], bool, dict[str, str]]:
    """(assignment, changed, moved): `host`'s unfinished buckets moved to `live` (hsx.fleetplan); the
    read -> write holds the file's lock (none is made where there is no file)."""
    if read_assignment(path) is None:
        raise _no_file_to_take_over(path, host)
    with _one_at_a_time(path, check_mode):
        return _takeover(path, host, finished, live, check_mode)


def _no_file_to_take_over(path: str, host: str) -> AssignmentFileError:
    return AssignmentFileError(f"{path}: no assignment to take {host} over from (the fleet has no derived split)")


def _takeover(
    path: str, host: str, finished: str, live: list[str], check_mode: bool
) -> tuple[dict[str, Any], bool, dict[str, str]]:
    recorded = read_assignment(path)
    if recorded is None:
        raise _no_file_to_take_over(path, host)
    done = _spec_set(finished, recorded["buckets"], f"finished buckets of {host}")
    try:
        new, moves = plan_takeover(recorded, host, done, live, _now())
    except AssignError as e:
        raise AssignmentFileError(f"{path}: {e}") from None
    changed = new is not recorded
    if changed and not check_mode:
        _write(path, new, recorded)
    return new, changed, {h: format_ranges(b) for h, b in moves.items()}


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
        if p["takeover"]:
            assignment, changed, moved = takeover(path, p["takeover"], p["finished"], p["live_hosts"], module.check_mode)
        else:
            assignment, changed, said, moved = resolve(
                path, list(p["hosts"]), p["buckets"], module.check_mode, p["create"], p["rebalance"], p["started"],
                p["answered"],
            )
            warnings += said
    except AssignmentFileError as e:
        module.fail_json(msg=str(e), path=path)
    for w in warnings:
        module.warn(w)
    new, gone = host_changes(assignment["hosts"], p["hosts"])
    module.exit_json(
        changed=changed or bool(migrated),
        path=os.path.abspath(p["path"]),
        migrated_from=migrated,
        assignment=assignment["hosts"],
        buckets=assignment["buckets"],
        created=assignment["created"],
        epoch=assignment.get("epoch", 0),
        retired=assignment.get("retired", []),
        moved=moved,
        new_hosts=new,
        gone_hosts=gone,
    )


if __name__ == "__main__":
    main()
