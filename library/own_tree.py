#!/usr/bin/python
# Copyright: (c) 2026, hsx maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module: give directory trees to an account without following a link (module_utils/hsx/owntree.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: own_tree
short_description: Make directories and give them, and everything below them, to an account without following links
description:
  - Makes each directory of O(paths) if absent (C(0750), missing parents root's C(0755)) and gives it and
    everything below it to O(owner):O(group) - walked by directory descriptors, never C(chown -R), at any
    depth. Every directory and regular file that is not already the account's gets that owner and loses the
    bits of others and setuid/setgid (files C(0640), directories C(0750) from the usual C(0644)/C(0755));
    what is already the account's keeps the modes the job gave it.
  - Never touched, only counted - links (their targets stay as they are), files with more than one hard link
    (one may be a planted link to a file outside, C(/etc/shadow) say) and anything not a directory or regular
    file (FIFOs, devices, sockets).
  - Refused, saying what and where, with nothing further changed - a top owned by someone other than root or
    the account (not ours to take), a link at a top written C(=PATH), and at a plain top a link that root did
    not make or that leads nowhere or to a non-directory.
  - Runs as root (C(become)).
version_added: "0.2.0"
author:
  - hsx maintainers (!UNKNOWN)
requirements:
  - python >= 3.10 on the managed host
options:
  paths:
    description:
      - The directories, absolute. C(PATH) - its top may be a link root made to a directory (the operator's path,
        the output on another disk say), followed at the top only; C(=PATH) - its top must be a real directory
        (a link there is refused, the dump directory say).
    type: list
    elements: str
    required: true
  owner:
    description: The account given the trees (a user name).
    type: str
    required: true
  group:
    description: Its group (a group name).
    type: str
    required: true
extends_documentation_fragment:
  - hsx.recovery.attributes
attributes:
  check_mode:
    support: full
    details:
      - Changes nothing and counts what would change; where the account does not exist yet (it would be made
        first) says so in RV(note) and reports changed.
  diff_mode:
    support: none
seealso:
  - module: ansible.builtin.file
    description: C(recurse=true) follows no links either, but changes every file's owner and mode alike and keeps no count.
"""

EXAMPLES = r"""
- name: Give the output (its top may be the operator's link) and the dump directory (never a link) to hsx
  own_tree:
    paths:
      - /data/hsx/output
      - =/run/hsx-dumps
    owner: hsx
    group: hsx
  become: true
"""

RETURN = r"""
paths:
  description: Per directory (the path without C(=)), what was done (or would be, in check mode).
  returned: success
  type: dict
  sample:
    /data/hsx/output: {created: false, changed: 12, skipped_links: 1, skipped_hardlinks: 0, skipped_other: 0}
  contains:
    created:
      description: The directory did not exist and was made.
      type: bool
    changed:
      description: Directories and files whose owner and mode were set.
      type: int
    skipped_links:
      description: Symbolic links below the top, left as they are.
      type: int
    skipped_hardlinks:
      description: Regular files with more than one hard link, left as they are.
      type: int
    skipped_other:
      description: Entries neither a directory nor a regular file (or gone while walked), left as they are.
      type: int
note:
  description: In check mode, why nothing could be counted (the account does not exist yet).
  returned: when the account does not exist in check mode
  type: str
  sample: "no account yet: hsx:hsx"
"""

import grp
import os
import pwd

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.hsx.owntree import OwnTreeError, own_trees  # noqa: E402


class OwnTree:
    """The trees of one task and the account they go to."""

    def __init__(self, module: AnsibleModule) -> None:
        self.module = module
        self.specs: list[str] = module.params["paths"]
        self.owner: str = module.params["owner"]
        self.group: str = module.params["group"]

    def check_specs(self) -> None:
        bad = [spec for spec in self.specs if not os.path.isabs(spec.lstrip("="))]
        if bad:
            self.module.fail_json(msg=f"paths: {', '.join(bad)} not absolute (PATH or =PATH, PATH absolute)")

    def account(self) -> tuple[int, int] | None:
        """(uid, gid); None in check mode where the account does not exist yet (it would be made first)."""
        try:
            return pwd.getpwnam(self.owner).pw_uid, grp.getgrnam(self.group).gr_gid
        except KeyError as exc:
            if self.module.check_mode:
                return None
            self.module.fail_json(msg=f"no such user or group: {exc.args[0]} (owner {self.owner}, group {self.group})")
        raise AssertionError("unreachable")

    def run(self) -> dict:
        self.check_specs()
        ids = self.account()
        if ids is None:
            return {"changed": True, "paths": {}, "note": f"no account yet: {self.owner}:{self.group}"}
        try:
            paths = own_trees(self.specs, *ids, check=self.module.check_mode)
        except OwnTreeError as exc:
            self.module.fail_json(msg=str(exc))
        changed = any(c["created"] or c["changed"] for c in paths.values())
        return {"changed": changed, "paths": paths}


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "paths": {"type": "list", "elements": "str", "required": True},
            "owner": {"type": "str", "required": True},
            "group": {"type": "str", "required": True},
        },
        supports_check_mode=True,
    )
    module.exit_json(**OwnTree(module).run())


if __name__ == "__main__":
    main()
