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
      (it would run nothing; adding hosts is a rebalance, a later item of issue 39); a host it names that is not in
      O(hosts) is a warning (its buckets stay its own).
    - Runs on the control node (C(delegate_to=localhost), C(run_once), C(become=false)). Check mode writes
      nothing and returns the assignment that would be written.
version_added: "0.1.0"
author:
    - hsx maintainers (!UNKNOWN)
requirements:
    - python >= 3.10 on the managed host
options:
    path:
        description: The assignment file (its directory is made if absent).
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
    path: "{{ inventory_dir }}/fleet/assignment.json"
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
    description: Hosts of O(hosts) the file does not name (always empty, since the task fails when there are any).
    type: list
    returned: success
gone_hosts:
    description: Hosts the file names that are not in O(hosts).
    type: list
    returned: success
"""

import datetime
import json
import os
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.hsx.buckets import AssignError, check_assignment, derive_assignment, host_changes
from ansible.module_utils.hsx.fsutil import LinkRefused, atomic_write_bytes, read_nofollow

MAX_FILE_BYTES = 4 << 20  # a thousand hosts' ranges are a few KiB


class AssignmentFileError(Exception):
    """The file cannot be read, written or believed; the message names it and says what to do."""


def read_assignment(path: str) -> dict[str, Any] | None:
    """The file's {buckets, created, hosts}, checked; None when there is none."""
    aside = "fix it, or move it aside to derive a new assignment (only before any node has started: it reassigns buckets)"
    try:
        raw = read_nofollow(path, MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except LinkRefused as e:
        raise AssignmentFileError(f"{e}; put the assignment file itself there") from None
    except OSError as e:
        raise AssignmentFileError(f"{path}: cannot read the assignment: {e.strerror or e}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise AssignmentFileError(f"{path}: over {MAX_FILE_BYTES} bytes, not an assignment this module wrote; {aside}")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise AssignmentFileError(f"{path}: not valid JSON ({e}); {aside}") from None
    hosts = data.get("hosts") if isinstance(data, dict) else None
    if not isinstance(hosts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in hosts.items()):
        raise AssignmentFileError(f"{path}: not an assignment (an object with 'hosts': host -> ranges); {aside}")
    try:
        check_assignment(hosts, data.get("buckets"), path)
    except AssignError as e:
        raise AssignmentFileError(f"{e}; {aside}") from None
    return {"buckets": data["buckets"], "created": str(data.get("created", "?")), "hosts": hosts}


def encode(assignment: dict[str, Any]) -> bytes:
    return (json.dumps(assignment, indent=2) + "\n").encode("utf-8")


def resolve(
    path: str, hosts: list[str], buckets: int, check_mode: bool, create: bool = True
) -> tuple[dict[str, Any], bool, list[str]]:
    """(assignment, changed, warnings): the file's assignment, made from `hosts` when there is none
    (AssignmentFileError then unless `create`)."""
    recorded = read_assignment(path)
    if recorded is None and not create:
        raise AssignmentFileError(
            f"{path}: no assignment yet, and this play runs on part of the fleet (--limit): one made from "
            f"{', '.join(hosts) or 'no host'} alone would give every other host nothing. Run the play once "
            "without --limit to make it (with --check first to see it), or set hsx_assignment_file: '' for no "
            "derived split"
        )
    if recorded is None:
        try:
            made = derive_assignment(hosts, buckets)
        except AssignError as e:
            raise AssignmentFileError(f"cannot derive the assignment for {path}: {e}") from None
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        assignment = {"buckets": buckets, "created": now, "hosts": made}
        if not check_mode:
            try:
                os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
                atomic_write_bytes(path, encode(assignment))
            except OSError as e:
                raise AssignmentFileError(f"{path}: cannot write the assignment: {e.strerror or e}") from None
        return assignment, True, []
    if recorded["buckets"] != buckets:
        raise AssignmentFileError(
            f"{path}: the assignment has {recorded['buckets']} buckets, the play asks for {buckets} (hsx_buckets): "
            f"the count is fixed once a fleet has an assignment; set hsx_buckets: {recorded['buckets']}, or, only "
            "before any node has started, move the file aside to derive a new one"
        )
    new, gone = host_changes(recorded["hosts"], hosts)
    if new:
        raise AssignmentFileError(
            f"{path}: host(s) {', '.join(new)} are not in the assignment made {recorded['created']} for "
            f"{', '.join(sorted(recorded['hosts']))}; they would run nothing. Moving buckets to new hosts is a "
            "rebalance, not done automatically yet (a later item of issue #39): leave them out of this play "
            "(--limit), or, only before any node has started, move the file aside to derive a new assignment"
        )
    warnings = []
    if gone:
        warnings.append(
            f"{path}: host(s) {', '.join(gone)} of the assignment are not in this play (--limit, or gone from the "
            "inventory): their buckets stay theirs and no other host runs them (moving them is a takeover, a "
            "later item of issue #39)"
        )
    return recorded, False, warnings


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "hosts": {"type": "list", "elements": "str", "required": True},
            "buckets": {"type": "int", "default": 1024},
            "create": {"type": "bool", "default": True},
        },
        supports_check_mode=True,
    )
    p = module.params
    path = os.path.abspath(p["path"])
    try:
        assignment, changed, warnings = resolve(path, list(p["hosts"]), p["buckets"], module.check_mode, p["create"])
    except AssignmentFileError as e:
        module.fail_json(msg=str(e), path=path)
    for w in warnings:
        module.warn(w)
    new, gone = host_changes(assignment["hosts"], p["hosts"])
    module.exit_json(
        changed=changed,
        path=path,
        assignment=assignment["hosts"],
        buckets=assignment["buckets"],
        created=assignment["created"],
        new_hosts=new,
        gone_hosts=gone,
    )


if __name__ == "__main__":
    main()
