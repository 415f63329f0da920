#!/usr/bin/python
# Copyright: (c) 2026, hsx maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module: where an interpreter's SGLang is, which release, and whether the dump patch supports it."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_info
short_description: Find an interpreter's SGLang install and its release, and whether the dump patch supports it
description:
  - Asks O(python) (the interpreter SGLang is installed for, a venv's) where the C(sglang) package is and
    which distribution version it is, without importing it (C(importlib.util.find_spec) of the top-level
    package runs none of its code; the version comes from its dist-info).
  - Says whether the release is one the dump patch was tested against (the supported releases are
    listed once, in the collection's C(sglang_versions) module_utils) and the oldest supported release.
  - With O(version) nothing is asked - that version is judged as if found.
  - Never fails for a missing install or an interpreter that cannot be run - RV(found) is false and
    RV(error) says why, for the role to say what to set; never changes anything.
version_added: "0.2.0"
author:
  - hsx maintainers (!UNKNOWN)
requirements:
  - python >= 3.10 on the managed host
  - O(python) a Python 3.8 or later (C(importlib.metadata))
options:
  python:
    description:
      - The interpreter to ask (for example C(/opt/sglang/bin/python)). Required unless O(version) is given.
    type: path
  version:
    description:
      - A version to judge instead of asking O(python) (a site that pins it). Empty asks.
    type: str
extends_documentation_fragment:
  - hsx.recovery.attributes
attributes:
  check_mode:
    support: full
    details: Reads only; runs the same in check mode, and says whether it ran in it (RV(check_mode)).
  diff_mode:
    support: none
seealso:
  - module: hsx.recovery.source_patch
    description: Patches SGLang's model file with the dump hook; refuses a release this module calls unsupported.
  - module: ansible.builtin.pip
    description: Installs SGLang into the venv this module asks.
"""

EXAMPLES = r"""
- name: Find SGLang in its venv
  sglang_info:
    python: /opt/sglang/bin/python
  register: sglang

- name: SGLang must be installed and supported
  ansible.builtin.assert:
    that: sglang.found and sglang.supported
    fail_msg: "{{ sglang.error or sglang.support_problem }}"

- name: Judge a pinned release without asking
  sglang_info:
    version: 0.5.14
  register: pinned
"""

RETURN = r"""
found:
  description: SGLang's package was found (RV(package) is set); false with O(version) (nothing was asked).
  returned: always
  type: bool
  sample: true
python:
  description: The interpreter that answered, links resolved (null with O(version), or when it could not be run).
  returned: always
  type: str
  sample: /opt/sglang/bin/python3.11
package:
  description: The directory of the C(sglang) package; null when not found.
  returned: always
  type: str
  sample: /opt/sglang/lib/python3.11/site-packages/sglang
version:
  description: The distribution's version as installed (or O(version)); null when unknown.
  returned: always
  type: str
  sample: 0.5.14+cu129
release:
  description: RV(version) without a local build label; empty when unknown.
  returned: always
  type: str
  sample: 0.5.14
supported:
  description: The release is one the dump patch supports.
  returned: always
  type: bool
  sample: true
support_problem:
  description: Why the release is not supported; null when it is.
  returned: always
  type: str
  sample: SGLang 0.5.4 is older than 0.5.10 (its ForwardBatch has no per-request ids)
min_version:
  description: The oldest release the dump patch supports.
  returned: always
  type: str
  sample: 0.5.10
error:
  description: Why the package was not found or the interpreter did not answer; null when found.
  returned: always
  type: str
  sample: no importable sglang package
check_mode:
  description:
    - Whether this ran in check mode - a play's or task's C(check_mode) included, which C(ansible_check_mode)
      does not reflect.
  returned: always
  type: bool
  sample: false
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.hsx.pyprobe import PACKAGE_PROBE, ProbeError, run_probe  # noqa: E402
from ansible.module_utils.hsx.sglang_versions import MIN_VERSION, base_version, support_problem  # noqa: E402


class SGLangInfo:
    """One interpreter's SGLang, as the module reports it."""

    def __init__(self, module: AnsibleModule) -> None:
        self.module = module
        self.python: str | None = module.params["python"]
        self.version: str | None = module.params["version"] or None

    def ask(self) -> dict:
        """What the interpreter says (or the pinned version): python, package, version, error."""
        if self.version:
            return {"python": None, "package": None, "version": self.version, "error": None}
        try:
            answer = run_probe(self.module.run_command, self.python, PACKAGE_PROBE, ["sglang"])
        except ProbeError as exc:
            return {"python": None, "package": None, "version": None, "error": str(exc)}
        return {key: answer.get(key) for key in ("python", "package", "version", "error")}

    def result(self) -> dict:
        found = self.ask()
        version = found["version"]
        problem = support_problem(version)
        return dict(found, found=bool(found["package"]),
                    release=base_version(version) if version else "", supported=problem is None,
                    support_problem=problem, min_version=MIN_VERSION, check_mode=self.module.check_mode)


def main() -> None:
    module = AnsibleModule(
        argument_spec={"python": {"type": "path"}, "version": {"type": "str"}},
        required_one_of=[("python", "version")],
        supports_check_mode=True,
    )
    module.exit_json(changed=False, **SGLangInfo(module).result())


if __name__ == "__main__":
    main()
