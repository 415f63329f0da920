#!/usr/bin/python
# Copyright: (c) 2026, hsx maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module: does a directory take a write that reads back (roles/storage_guard's data mount check)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: write_probe
short_description: Check that a directory takes a write, fsync and read back
description:
  - Writes O(size) random bytes to a new file in O(path), syncs it to the disk, reads it back through the same
    descriptor and removes it - what a mount mounted read-write but failing (a full quota, permissions, a disk
    returning I/O errors) does not do.
  - The file is new and ours alone - a name nobody can guess, created C(O_EXCL|O_NOFOLLOW); only that file is
    removed. Root runs this in a mount's root, which other users may be able to write - a predictable name
    could be planted as a link, and root would overwrite its target.
  - Does not fail when the write fails - RV(writable) is false and RV(error) says what failed, for the role to
    say what to check. Leaves nothing behind, so never reports a change.
version_added: "0.2.0"
author:
  - hsx maintainers (!UNKNOWN)
requirements:
  - python >= 3.10 on the managed host
options:
  path:
    description: The directory to probe (the data mount's root, say).
    type: path
    required: true
  size:
    description: How many bytes to write.
    type: int
    default: 4096
extends_documentation_fragment:
  - hsx.recovery.attributes
attributes:
  check_mode:
    support: full
    details: Writes nothing; RV(probed) is false and RV(writable) null.
  diff_mode:
    support: none
seealso:
  - module: hsx.recovery.dump_space_info
    description: The room for the SGLang dumps (the other storage check).
  - module: ansible.builtin.tempfile
    description: Makes a temporary file, but leaves it (and writes nothing into it).
"""

EXAMPLES = r"""
- name: Write, fsync and read back a probe file on the data mount
  write_probe:
    path: /data
  register: probe

- name: The data mount must be writable
  ansible.builtin.assert:
    that: probe.writable
    fail_msg: "/data is not writable: {{ probe.error }}"
"""

RETURN = r"""
probed:
  description: The probe ran (false in check mode).
  returned: always
  type: bool
  sample: true
writable:
  description: The bytes were written, synced and read back; null when not probed.
  returned: always
  type: bool
  sample: true
error:
  description: What failed, naming the file; null when nothing did.
  returned: always
  type: str
  sample: "cannot write /data/.hsx-write-probe.*: Disk quota exceeded"
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.hsx.hostfs import write_probe  # noqa: E402


class WriteProbe:
    """One probe of one directory."""

    def __init__(self, module: AnsibleModule) -> None:
        self.module = module
        self.path: str = module.params["path"]
        self.size: int = module.params["size"]

    def run(self) -> dict:
        if self.size < 1:
            self.module.fail_json(msg=f"size: {self.size} is not a positive number of bytes")
        if self.module.check_mode:
            return {"probed": False, "writable": None, "error": None}
        error = write_probe(self.path, self.size)
        return {"probed": True, "writable": error is None, "error": error}


def main() -> None:
    module = AnsibleModule(
        argument_spec={"path": {"type": "path", "required": True}, "size": {"type": "int", "default": 4096}},
        supports_check_mode=True,
    )
    module.exit_json(changed=False, **WriteProbe(module).run())


if __name__ == "__main__":
    main()
