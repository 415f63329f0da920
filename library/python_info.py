#!/usr/bin/python
# Copyright: (c) 2026, hsx maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module: what another Python interpreter on the host is and which modules it can import."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: python_info
short_description: Ask a Python interpreter on the host its version and which of some modules it can import
description:
  - Runs O(python) (not the interpreter Ansible runs the module with) and asks it to import each of
    O(modules); says its version and, per module that fails, why. The deploy asks the host Python that
    builds the extraction's venv for C(venv) and C(ensurepip), which Debian ships apart (C(python3-venv)).
  - Importing runs the modules' code - name standard-library modules, or ones you trust.
  - Never fails for a module that is missing or an interpreter that cannot be run - RV(usable) is false and
    RV(missing) or RV(error) says why, for the role to say what to install. Never changes anything.
version_added: "0.2.0"
author:
  - hsx maintainers (!UNKNOWN)
requirements:
  - python >= 3.10 on the managed host
options:
  python:
    description: The interpreter to ask.
    type: path
    default: /usr/bin/python3
  modules:
    description: The modules it must be able to import.
    type: list
    elements: str
    default: []
extends_documentation_fragment:
  - hsx.recovery.attributes
attributes:
  check_mode:
    support: full
    details: Reads only; runs the same in check mode.
  diff_mode:
    support: none
seealso:
  - module: hsx.recovery.sglang_info
    description: The same question of SGLang's interpreter, for the SGLang package and its release.
  - module: ansible.builtin.pip
    description: Its C(virtualenv_command) builds a venv with the interpreter this module asks.
"""

EXAMPLES = r"""
- name: The host Python must be able to create a venv
  python_info:
    python: /usr/bin/python3
    modules: [venv, ensurepip]
  register: host_python

- name: Report a missing venv module
  ansible.builtin.assert:
    that: host_python.usable
    fail_msg: "{{ host_python.error or host_python.missing }} - on Debian install python3-venv"
"""

RETURN = r"""
usable:
  description: The interpreter ran and imported every module of O(modules).
  returned: always
  type: bool
  sample: true
python:
  description: The interpreter that answered, links resolved; null when it could not be run.
  returned: always
  type: str
  sample: /usr/bin/python3.11
version:
  description: Its version; null when it could not be run.
  returned: always
  type: str
  sample: 3.11.2
missing:
  description: Each module it could not import, with why.
  returned: always
  type: dict
  sample: {ensurepip: "ModuleNotFoundError: No module named 'ensurepip'"}
error:
  description: Why the interpreter did not answer; null when it did.
  returned: always
  type: str
  sample: "cannot run /usr/bin/python3: No such file or directory"
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.hsx.pyprobe import IMPORT_PROBE, ProbeError, run_probe  # noqa: E402


class PythonInfo:
    """One interpreter, asked once."""

    def __init__(self, module: AnsibleModule) -> None:
        self.module = module
        self.python: str = module.params["python"]
        self.modules: list[str] = module.params["modules"]

    def run(self) -> dict:
        try:
            answer = run_probe(self.module.run_command, self.python, IMPORT_PROBE, self.modules)
        except ProbeError as exc:
            return {"usable": False, "python": None, "version": None, "missing": {}, "error": str(exc)}
        missing = answer.get("missing") or {}
        return {"usable": not missing, "python": answer.get("python"), "version": answer.get("version"),
                "missing": missing, "error": None}


def main() -> None:
    module = AnsibleModule(
        argument_spec={"python": {"type": "path", "default": "/usr/bin/python3"},
                       "modules": {"type": "list", "elements": "str", "default": []}},
        supports_check_mode=True,
    )
    module.exit_json(changed=False, **PythonInfo(module).run())


if __name__ == "__main__":
    main()
