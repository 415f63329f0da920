#!/usr/bin/python
# Copyright: (c) 2026, hsx maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: source_patch
short_description: Insert or remove anchored, versioned blocks of code in a source file
description:
    - Inserts blocks of lines right after or before anchor lines of a source file. Each block sits between
      marker comments naming the patch, the block, the patch version, a digest of the patch content and a
      digest of the unpatched file, so the module knows whether the wanted version is applied (no change),
      an older or different one is (it is replaced in place), or none is.
    - Unlike M(ansible.posix.patch), which decides "applied" with a reverse dry run and therefore fails once
      v1 is applied and v2 is wanted, this module upgrades in place and reverts to the original byte for
      byte (O(state=absent)), checking the restored text against the digest recorded at apply time.
    - An anchor must match exactly one line (compared without surrounding whitespace); the block takes the
      anchor line's indentation and line ending. Otherwise the module fails and changes nothing, unless
      O(force=true) and the anchor matches several lines (the first is used). A missing anchor always fails.
    - For Python files the patched text must parse (C(ast.parse)) before anything is written.
    - Writes are atomic (temp file, fsync, rename) and keep the file's mode.
    - Uses the same code as C(hsx patch) (module_utils C(hsx.patching)), so both read the same markers.
    - For SGLang's dump patch, O(sglang_package) instead of O(path) picks the model file from the target
      (O(sglang_target), or the model's C(config.json) C(architectures) with O(sglang_model); module_utils
      C(hsx.sglang_patch) C(TARGETS)) and that file's named patch, and refuses a target the release refuses,
      by name, before any change.
version_added: "0.1.0"
author:
    - hsx maintainers (!UNKNOWN)
options:
    path:
        description:
            - The file to patch. Required unless O(sglang_package) is given (mutually exclusive with it).
        type: path
    patch:
        description:
            - A named patch shipped with this project. V(sglang_dump_hook) makes SGLang's
              C(srt/models/deepseek_v2.py) call the hidden-state dump hook (C(sglang/hsx_dump_hook.py));
              V(sglang_dump_hook_llama) its C(srt/models/llama.py), V(sglang_dump_hook_qwen2) its
              C(srt/models/qwen2.py).
            - Mutually exclusive with O(patch_id). With O(sglang_package), the target file's own (the default).
        type: str
        choices: [ sglang_dump_hook, sglang_dump_hook_llama, sglang_dump_hook_qwen2 ]
    patch_id:
        description:
            - Identifier of an ad hoc patch given by O(blocks); letters, digits, underscore, dot, colon, dash.
        type: str
    version:
        description:
            - Version of the ad hoc patch; recorded in the markers and reported.
        type: str
        default: "1"
    blocks:
        description:
            - The blocks of an ad hoc patch.
        type: list
        elements: dict
        suboptions:
            name:
                description: Block name, unique within the patch.
                type: str
                required: true
            anchor:
                description: Text of the one line the block is placed next to (whitespace around it ignored).
                type: str
                required: true
            where:
                description: Insert right V(after) or V(before) the anchor line.
                type: str
                choices: [ after, before ]
                default: after
            code:
                description: Lines to insert, indented relative to the anchor line.
                type: list
                elements: str
                required: true
    state:
        description:
            - V(present) applies the patch (or upgrades an older version); V(absent) removes its blocks.
        type: str
        choices: [ present, absent ]
        default: present
    force:
        description:
            - Apply even when an anchor matches several lines (at the first match).
        type: bool
        default: false
    backup:
        description:
            - Keep a timestamped copy of the file before changing it.
        type: bool
        default: false
    validate:
        description:
            - V(auto) checks that the patched text parses when the file name ends in C(.py); V(python) always
              does; V(none) never does.
        type: str
        choices: [ auto, python, none ]
        default: auto
    sglang_version:
        description:
            - The installed SGLang version (for O(patch=sglang_dump_hook), or an ad hoc revision of it given by
              O(patch_id)); the module fails before any change when it is not a supported release
              (module_utils C(hsx.sglang_versions)), or, with O(sglang_package), when the release refuses
              the target.
        type: str
    sglang_package:
        description:
            - The C(sglang) package directory (where C(srt/models/) is); the file patched is the target's
              (returned as RV(path)).
        type: path
    sglang_target:
        description:
            - With O(sglang_package), the target, which decides the file patched, its class and its named
              patch. V(deepseek_v2) (C(DeepseekV2Model), also Kimi-K2.5), V(llama) (C(LlamaModel)), V(qwen2)
              (C(Qwen2Model)), V(qwen3) (C(Qwen3Model) through C(qwen2.py)'s C(Qwen2Model), to SGLang 0.5.20).
            - V(auto) reads the target from O(sglang_model)'s C(config.json) C(architectures); unset, from
              O(sglang_model) when given, else V(deepseek_v2).
        type: str
        choices: [ auto, deepseek_v2, llama, qwen2, qwen3 ]
    sglang_model:
        description:
            - With O(sglang_package), the model directory the server runs (its C(config.json) is read, a
              regular file of at most 1 MiB, for O(sglang_target=auto)).
        type: path
extends_documentation_fragment:
  - hsx.recovery.attributes
attributes:
    check_mode:
        support: full
        details: Reports whether the file would change (and the diff with C(--diff)); writes nothing.
    diff_mode:
        support: full
        details: The full before and after text of the file, rendered by Ansible as a unified diff.
requirements:
    - python >= 3.10 on the managed host
seealso:
    - module: ansible.posix.patch
"""

EXAMPLES = r"""
- name: Make SGLang call the dump hook
  source_patch:
    path: /opt/sglang/lib/python3.11/site-packages/sglang/srt/models/deepseek_v2.py
    patch: sglang_dump_hook
    sglang_version: "0.5.23"
    backup: true
  register: dump_patch

- name: Remove it again (the original comes back byte for byte)
  source_patch:
    path: /opt/sglang/lib/python3.11/site-packages/sglang/srt/models/deepseek_v2.py
    patch: sglang_dump_hook
    state: absent

- name: Make SGLang call the dump hook from the file the model needs (for a Llama, srt/models/llama.py)
  source_patch:
    sglang_package: /opt/sglang/lib/python3.11/site-packages/sglang
    sglang_target: auto
    sglang_model: /data/models/Llama-3.1-8B-Instruct
    sglang_version: "0.5.23"

- name: An ad hoc patch
  source_patch:
    path: /srv/app/server.py
    patch_id: trace-requests
    version: "3"
    blocks:
      - name: log
        anchor: "def handle(self, request):"
        where: after
        code:
          - "    log.debug('request %s', request.id)"
"""

RETURN = r"""
before:
    description: The file's status before the task; V(unpatched), V(patched), V(outdated) or V(unsupported).
    returned: always
    type: str
    sample: outdated
after:
    description: The file's status after the task (as it would be, in check mode).
    returned: always
    type: str
    sample: patched
found_version:
    description: Version(s) of this patch found in the file before the task, comma-separated.
    returned: always
    type: str
    sample: "1"
patch_version:
    description: Version of the wanted patch.
    returned: always
    type: str
    sample: "2"
digest:
    description: Digest of the wanted patch's content, as written in its markers.
    returned: always
    type: str
    sample: 441b8149a284
reason:
    description: Why the file was classified as it was before the task.
    returned: always
    type: str
    sample: holds v1 (3c5d0e2a9f11); wanted v2 (441b8149a284)
backup_file:
    description: The copy made before changing the file.
    returned: changed and O(backup=true) and not in check mode
    type: str
    sample: /opt/sglang/.../deepseek_v2.py.12345.2026-01-01@10:00:00~
path:
    description: The file patched (with O(sglang_package), the target's).
    returned: always
    type: str
    sample: /opt/sglang/lib/python3.11/site-packages/sglang/srt/models/llama.py
sglang_target:
    description: The target the file was chosen for.
    returned: when O(sglang_package) is given
    type: str
    sample: llama
model_class:
    description: The SGLang model class whose C(__init__) and C(forward) hold the patch's blocks.
    returned: when O(sglang_package) is given
    type: str
    sample: LlamaModel
patch_name:
    description: The named patch of the target's file (what O(patch) takes).
    returned: when O(sglang_package) is given
    type: str
    sample: sglang_dump_hook_llama
original_verified:
    description: With O(state=absent), whether the restored text hashes to the original recorded at apply time.
    returned: when O(state=absent) and blocks were removed
    type: bool
    sample: true
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.hsx.patching import (  # noqa: E402
    Patch,
    PatchError,
    check_python,
    plan,
    read_text,
    sha12,
    write_atomic,
)
from ansible.module_utils.hsx.sglang_patch import NAMED_PATCHES, TARGETS  # noqa: E402
from ansible.module_utils.hsx.sglang_versions import (  # noqa: E402
    TargetError,
    resolve_target,
    support_problem,
    target_file,
    target_problem,
)

ARGUMENT_SPEC = dict(
    path=dict(type="path"),
    patch=dict(type="str", choices=sorted(NAMED_PATCHES)),
    patch_id=dict(type="str"),
    version=dict(type="str", default="1"),
    blocks=dict(
        type="list",
        elements="dict",
        options=dict(
            name=dict(type="str", required=True),
            anchor=dict(type="str", required=True),
            where=dict(type="str", default="after", choices=["after", "before"]),
            code=dict(type="list", required=True, elements="str"),
        ),
    ),
    state=dict(type="str", default="present", choices=["present", "absent"]),
    force=dict(type="bool", default=False),
    backup=dict(type="bool", default=False),
    validate=dict(type="str", default="auto", choices=["auto", "python", "none"]),
    sglang_version=dict(type="str"),
    sglang_package=dict(type="path"),
    sglang_target=dict(type="str", choices=["auto", *sorted(TARGETS)]),
    sglang_model=dict(type="path"),
)


class SourcePatchModule:
    """The module: plans the patch (module_utils' plan, shared with `hsx patch`), checks it and writes it."""

    def __init__(self, module: AnsibleModule):
        self.module = module
        self.params = module.params

    def target(self) -> dict:
        """With sglang_package: the target, its file (params' path set to it) and its named patch."""
        p = self.params
        try:
            target = resolve_target(p["sglang_target"], p["sglang_model"])
        except TargetError as exc:
            self.module.fail_json(msg=f"cannot choose the SGLang file to patch: {exc}", changed=False)
        info = target_file(target)
        if p["patch"] and p["patch"] != info["patch"]:
            self.module.fail_json(
                msg=f"patch {p['patch']} is not {info['file']}'s ({info['patch']}, target {target})"
            )
        if not p["patch_id"]:
            p["patch"] = info["patch"]
        p["path"] = f"{p['sglang_package'].rstrip('/')}/{info['file']}"
        return {"sglang_target": target, "model_class": info["model_class"], "patch_name": info["patch"]}

    def patch(self) -> Patch:
        p = self.params
        if p["patch"]:
            return Patch.from_dict(NAMED_PATCHES[p["patch"]])
        if not p["blocks"]:
            self.module.fail_json(msg="patch_id needs blocks")
        try:
            return Patch.from_dict({"id": p["patch_id"], "version": p["version"], "blocks": p["blocks"]})
        except (ValueError, KeyError) as exc:
            self.module.fail_json(msg=f"bad patch definition: {exc}")

    def run(self) -> dict:
        p = self.params
        chosen = self.target() if p["sglang_package"] else {}
        path = p["path"]
        patch = self.patch()
        if p["sglang_version"] is not None and p["state"] == "present":
            problem = support_problem(p["sglang_version"])
            if chosen:
                problem = problem or target_problem(chosen["sglang_target"], p["sglang_version"])
            if problem:
                self.module.fail_json(
                    msg=f"{path}: {problem}; nothing changed", changed=False, path=path, **chosen
                )
        try:
            text = read_text(path)
            new_text, ins = plan(text, patch, p["state"], p["force"])
            changed = new_text != text
            validate = p["validate"]
            if (
                changed
                and p["state"] == "present"
                and (validate == "python" or (validate == "auto" and path.endswith(".py")))
            ):
                check_python(new_text, path)
        except PatchError as exc:
            self.module.fail_json(msg=str(exc), changed=False, path=path, **chosen)
        result = {
            **chosen,
            "path": path,
            "changed": changed,
            "before": ins.status,
            "after": "patched" if p["state"] == "present" else "unpatched",
            "found_version": ins.found_version,
            "patch_version": patch.version,
            "digest": patch.digest,
            "reason": ins.reason,
        }
        if p["state"] == "absent" and ins.found:
            result["original_verified"] = all(b.orig == sha12(new_text) for b in ins.found)
            if not result["original_verified"]:
                self.module.warn(
                    f"{path}: removed the blocks, but the rest of the file changed since they were applied"
                )
        if changed:
            if self.module._diff:  # the whole file twice: only when --diff asks for it
                result["diff"] = {
                    "before": text,
                    "after": new_text,
                    "before_header": path,
                    "after_header": path,
                }
            if not self.module.check_mode:
                if p["backup"]:
                    result["backup_file"] = self.module.backup_local(path)
                try:
                    write_atomic(path, new_text)
                except OSError as exc:
                    self.module.fail_json(msg=f"{path}: cannot write: {exc}", **result)
        return result


def main() -> None:
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        mutually_exclusive=[("patch", "patch_id"), ("path", "sglang_package")],
        required_one_of=[("path", "sglang_package"), ("patch", "patch_id", "sglang_package")],
        required_by={
            "blocks": "patch_id",
            "sglang_target": "sglang_package",
            "sglang_model": "sglang_package",
        },
        supports_check_mode=True,
    )
    module.exit_json(**SourcePatchModule(module).run())


if __name__ == "__main__":
    main()
