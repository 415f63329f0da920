#!/usr/bin/python
# Copyright: (c) 2026, hsx maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module: the numbers roles/storage_guard sizes the SGLang dump directory from."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: dump_space_info
short_description: Measure a dump directory's filesystem, the host's available RAM and a model's width
description:
  - Reads what sizing the SGLang backend's dump directory needs - the filesystem that holds O(path) (the
    directory itself, or where it would be made - its nearest existing ancestor) with its mount point, type
    (C(tmpfs) is RAM) and free bytes; the host's available memory (C(MemAvailable)); and the width and length
    of the model at O(model_path) (C(hidden_size), C(max_position_embeddings), under C(text_config) where a
    multimodal model keeps them).
  - A model whose C(config.json) cannot be read gives 0 for both and says why in RV(model_error) - the
    role then keeps the dumps where they are, unsized, and says so. Never changes anything.
version_added: "0.2.0"
author:
  - hsx maintainers (!UNKNOWN)
requirements:
  - python >= 3.10 on the managed host
  - Linux (C(/proc/mounts), C(/proc/meminfo))
options:
  path:
    description: The dump directory (it need not exist yet).
    type: path
    required: true
  model_path:
    description: The model directory (its C(config.json) is read).
    type: path
    required: true
extends_documentation_fragment:
  - hsx.recovery.attributes
attributes:
  check_mode:
    support: full
    details: Reads only; runs the same in check mode.
  diff_mode:
    support: none
  platform:
    platforms: linux
seealso:
  - module: hsx.recovery.write_probe
    description: Whether the data mount takes a write that reads back (the other storage check).
  - module: ansible.builtin.setup
    description: C(ansible_mounts) and C(ansible_memfree_mb) give similar numbers for every mount, at the cost of gathering facts.
"""

EXAMPLES = r"""
- name: Measure where the dumps would go
  dump_space_info:
    path: /run/hsx-dumps
    model_path: /data/models/Kimi-K2.5
  register: room

- name: Say whether the dumps are in RAM
  ansible.builtin.debug:
    msg: "{{ room.mount }} ({{ room.fstype }}): {{ room.free_bytes | human_readable }} free"
"""

RETURN = r"""
measured:
  description: The directory measured (O(path), or its nearest existing ancestor).
  returned: always
  type: str
  sample: /run
mount:
  description: The mount point holding it.
  returned: always
  type: str
  sample: /run
fstype:
  description: That mount's filesystem type.
  returned: always
  type: str
  sample: tmpfs
free_bytes:
  description: Bytes still free there for an unprivileged writer.
  returned: always
  type: int
  sample: 33554432000
mem_available:
  description: The host's available memory in bytes (C(MemAvailable)).
  returned: always
  type: int
  sample: 1082331758592
hidden:
  description: The model's hidden size; 0 when unknown.
  returned: always
  type: int
  sample: 7168
max_positions:
  description: The model's longest sequence (C(max_position_embeddings)); 0 when unknown.
  returned: always
  type: int
  sample: 262144
model_error:
  description: Why the model's config could not be read; null when it was.
  returned: always
  type: str
  sample: "/data/models/x/config.json: cannot read the model's config: No such file or directory"
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.hsx.hostfs import existing_ancestor, free_bytes, mem_available, mount_of  # noqa: E402
from ansible.module_utils.hsx.modelconfig import read_config, text_dims  # noqa: E402


class DumpSpace:
    """The numbers for one dump directory and model."""

    def __init__(self, module: AnsibleModule) -> None:
        self.module = module
        self.path: str = module.params["path"]
        self.model_path: str = module.params["model_path"]

    def model(self) -> dict:
        try:
            hidden, positions = text_dims(read_config(self.model_path))
        except (OSError, ValueError) as exc:
            return {"hidden": 0, "max_positions": 0, "model_error": str(exc)}
        return {"hidden": hidden, "max_positions": positions, "model_error": None}

    def measure(self) -> dict:
        measured = existing_ancestor(self.path)
        try:
            mount, fstype = mount_of(measured)
            room = {"measured": measured, "mount": mount, "fstype": fstype, "free_bytes": free_bytes(measured),
                    "mem_available": mem_available()}
        except OSError as exc:
            self.module.fail_json(msg=f"cannot measure {measured} (for {self.path}): {exc.strerror or exc}")
        return {**room, **self.model()}


def main() -> None:
    module = AnsibleModule(
        argument_spec={"path": {"type": "path", "required": True}, "model_path": {"type": "path", "required": True}},
        supports_check_mode=True,
    )
    module.exit_json(changed=False, **DumpSpace(module).measure())


if __name__ == "__main__":
    main()
