#!/usr/bin/python
# Copyright: (c) 2026, hsx maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: shard_verify
short_description: Verify hidden-state shards of an extraction run and quarantine bad ones
description:
    - Checks every shard under O(path)/shards/ without trusting the files, with the same code as C(hsx verify)
      (shipped to the host through module_utils, so the extraction package need not be installed).
    - V(quick) checks the zip structure and the pickled tensor metadata against C(run.json) without importing
      torch and without executing the pickle; V(full) adds the CRC32 of every record and the index's size and
      checksum; V(deep) also loads the tensors and checks dtypes, finite values, token ids and the loss mask.
    - Reconciles the index with the disk, reporting samples indexed but missing and shards not indexed.
    - With O(quarantine=true), bad shards move to O(path)/quarantine/ with a reason file, bad and missing
      samples are marked not done in the index (so a resume re-extracts them) and stale writer temp files
      are deleted. Nothing moves when any file could not be read.
    - Finding bad shards does not fail the module; the caller decides (see the C(shard_verify) role).
version_added: "0.1.0"
author:
    - hsx maintainers (!UNKNOWN)
options:
    path:
        description:
            - The run's output directory, the one holding C(run.json).
        type: path
        required: true
    level:
        description:
            - How deep to check. V(deep) needs torch and the C(hsx-extraction) package on the host.
            - The default here is V(full), unlike C(hsx verify), whose default is V(quick). This module
              runs unattended after a crash, where a torn or damaged write is likely and reading every
              byte for its CRC32 is worth the time; C(hsx verify) is run by people, and V(quick) is what a
              resume trusts.
        type: str
        choices: [ quick, full, deep ]
        default: full
    quarantine:
        description:
            - Move bad shards aside, mark bad and missing samples not done, delete stale temp files.
            - When V(false) the module only reports.
        type: bool
        default: false
    workers:
        description:
            - Parallel worker processes; V(0) means one per CPU but one (at most 16; all of them on 1-2 CPUs).
        type: int
        default: 0
    orphan_min_age:
        description:
            - Only temp files older than this many seconds are deleted; younger ones may belong to a live writer.
        type: float
        default: 600
    max_listed:
        description:
            - Cap on the number of bad shards, missing samples and unindexed paths listed in the result;
              the counts are always complete.
        type: int
        default: 50
seealso:
  - module: hsx.recovery.extraction_status_info
    description: Reports the extraction's progress, counting the shards this module verifies.
  - module: hsx.recovery.own_tree
    description: Gives the output, shards and quarantine included, to the job's account.
extends_documentation_fragment:
  - hsx.recovery.attributes
attributes:
    check_mode:
        support: full
        details: Reports what would be quarantined and removed; changes nothing.
    diff_mode:
        support: full
        details: Lists the shards that move and the temp files that are deleted.
requirements:
    - python >= 3.10 on the managed host
    - torch and hsx-extraction on the host for O(level=deep)
notes:
    - Run it while the extraction job is stopped, or keep O(orphan_min_age) above the time one shard takes to write.
"""

EXAMPLES = r"""
- name: Check the shards, report only
  shard_verify:
    path: /data/hidden_states/run1
    level: full
  register: shards

- name: Quarantine bad shards so the resumed run re-extracts them
  shard_verify:
    path: /data/hidden_states/run1
    level: full
    quarantine: true

- name: Value-level check on a host with torch
  shard_verify:
    path: /data/hidden_states/run1
    level: deep
    workers: 4
"""

RETURN = r"""
level:
    description: The level that was checked.
    returned: always
    type: str
    sample: full
checked:
    description: Number of shard files checked.
    returned: always
    type: int
    sample: 18421
ok:
    description: Number of shards that passed.
    returned: always
    type: int
    sample: 18419
bad_count:
    description: Number of bad shards (including index entries that point outside shards/).
    returned: always
    type: int
    sample: 2
bad:
    description: Bad shards, at most O(max_listed).
    returned: always
    type: list
    elements: dict
    sample:
        - sample_id: conv-17
          path: shards/3f/conv-17.pt
          reason: zip end-of-central-directory record missing (truncated or not a torch.save file)
missing_count:
    description: Samples the index lists whose shard is not on disk.
    returned: always
    type: int
    sample: 0
missing:
    description: Their sample ids, at most O(max_listed).
    returned: always
    type: list
    elements: str
    sample: []
unindexed_count:
    description: Shards on disk that the index does not list (e.g. a crash between rename and index append).
    returned: always
    type: int
    sample: 1
unindexed:
    description: Their paths relative to O(path), at most O(max_listed).
    returned: always
    type: list
    elements: str
    sample: ["shards/a0/conv-99.pt"]
orphans:
    description: Writer temp files found (relative paths).
    returned: always
    type: list
    elements: str
    sample: ["shards/a0/.conv-100.pt.4242.1a2b3c4d.tmp"]
orphans_removed:
    description: Temp files deleted (or that would be, in check mode).
    returned: always
    type: int
    sample: 1
quarantined_count:
    description: How many bad shards were moved (or would be, in check mode); not capped by O(max_listed).
    returned: always
    type: int
    sample: 1
quarantined:
    description: Where bad shards were moved (or would be, in check mode), relative to O(path), at most O(max_listed).
    returned: always
    type: list
    elements: str
    sample: ["quarantine/3f/conv-17.pt"]
bytes:
    description: Bytes read.
    returned: always
    type: int
    sample: 2300000000000
seconds:
    description: Time the verification took.
    returned: always
    type: float
    sample: 41.2
"""

import os
import time

from ansible.module_utils.basic import AnsibleModule, missing_required_lib
from ansible.module_utils.hsx.verify import LEVELS, ManifestError, default_workers, verify_output

try:
    from extraction.shards.verify import deep_check
except ImportError:
    deep_check = None

ARGUMENT_SPEC = dict(
    path=dict(type="path", required=True),
    level=dict(type="str", default="full", choices=list(LEVELS)),
    quarantine=dict(type="bool", default=False),
    workers=dict(type="int", default=0),
    orphan_min_age=dict(type="float", default=600),
    max_listed=dict(type="int", default=50),
)


class ShardVerifyModule:
    """The module: verifies (and with quarantine, repairs) the run with the task's arguments;
    the verification itself is module_utils' verify_output, shared with `hsx verify`."""

    def __init__(self, module):
        self.module = module
        self.params = module.params

    def run(self):
        p = self.params
        if p["workers"] < 0 or p["max_listed"] < 0:
            self.module.fail_json(msg="workers and max_listed must not be negative")
        if p["level"] == "deep" and deep_check is None:
            self.module.fail_json(
                msg=missing_required_lib("hsx-extraction with torch", reason="for level=deep")
            )
        workers = p["workers"] or default_workers()
        try:
            report = verify_output(
                p["path"],
                p["level"],
                quarantine=p["quarantine"],
                check_mode=self.module.check_mode,
                workers=workers,
                deep_check=deep_check if p["level"] == "deep" else None,
                orphan_min_age=p["orphan_min_age"],
            )
        except ManifestError as e:
            self.module.fail_json(msg=str(e))
        except OSError as e:
            self.module.fail_json(msg=f"{e.filename or p['path']}: {e.strerror or e}")
        if report.errors:
            self.module.fail_json(
                msg=f"{len(report.errors)} shards could not be read; nothing was moved: {report.errors[0]}",
                errors=report.errors[: p["max_listed"]],
            )
        return self.result(report)

    def would_remove(self, orphans):
        cutoff = time.time() - self.params["orphan_min_age"]
        out = []
        for rel in orphans:
            try:
                if os.lstat(os.path.join(self.params["path"], rel)).st_mtime <= cutoff:
                    out.append(rel)
            except FileNotFoundError:
                continue
        return out

    def result(self, report):
        cap = self.params["max_listed"]
        acting = self.params["quarantine"]
        movable = [b for b in report.bad if not b.reason.endswith("(not touched)")]
        if self.module.check_mode:
            quarantined = [f"quarantine/{b.path.split('/', 1)[1]}" for b in movable] if acting else []
            removed = len(self.would_remove(report.orphans)) if acting else 0
            changed = bool(acting and (report.bad or report.missing or removed))
        else:
            quarantined = report.quarantined
            removed = report.orphans_removed
            changed = bool(quarantined or removed or (acting and (report.missing or report.bad)))
        result = {
            "changed": changed,
            "level": report.level,
            "checked": report.checked,
            "ok": report.ok,
            "bad_count": len(report.bad),
            "bad": [{"sample_id": b.sample_id, "path": b.path, "reason": b.reason} for b in report.bad[:cap]],
            "missing_count": len(report.missing),
            "missing": report.missing[:cap],
            "unindexed_count": len(report.unindexed),
            "unindexed": report.unindexed[:cap],
            "orphans": report.orphans[:cap],
            "orphans_removed": removed,
            "quarantined_count": len(quarantined),
            "quarantined": quarantined[:cap],
            "bytes": report.bytes,
            "seconds": round(report.seconds, 3),
        }
        if self.module._diff and changed:
            result["diff"] = {
                "before": "".join(f"{b.path}\n" for b in movable),
                "after": "".join(f"{q}\n" for q in quarantined),
                "before_header": "shards",
                "after_header": "quarantine",
            }
        return result


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    module.exit_json(**ShardVerifyModule(module).run())


if __name__ == "__main__":
    main()
