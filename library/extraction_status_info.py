#!/usr/bin/python
# Copyright: (c) 2026, hsx maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Ansible module: where an extraction stands on a host (status.json + the index)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: extraction_status_info
short_description: Report the progress of a hidden-state extraction on a host
description:
  - Reads C(status.json) and the shard index of an extraction output directory and returns how
    many samples are done, the total, the rate, the ETA, the run state, whether the extraction
    process is alive and whether it made progress recently.
  - The index is the truth for C(done); C(status.json) (rewritten every few seconds by the running
    extraction) gives the state, total, rate and the process id.
  - Works on hosts where the extraction package is not installed (the code ships with the module).
  - Never changes anything; safe in check mode.
version_added: "0.2.0"
author:
  - hsx maintainers (!UNKNOWN)
requirements:
  - python >= 3.10 on the managed host
options:
  path:
    description:
      - The extraction output directory (holds C(run.json), C(index.jsonl), C(status.json)); the same
        option as M(hsx.recovery.shard_verify)'s O(hsx.recovery.shard_verify#module:path), so
        C(module_defaults) for the group C(hsx.recovery.extraction_output) sets it once for both.
      - Was C(output_dir) (kept as an alias, so playbooks that name it go on working).
    type: path
    required: true
    aliases: [output_dir]
  progress_window:
    description:
      - Seconds within which C(done) must have grown (by the status history) or the status been
        refreshed by a live process for C(making_progress) to be true.
    type: int
    default: 120
  min_done_increase:
    description: With I(baseline_done), how many more samples than the baseline count as progress.
    type: int
    default: 1
  baseline_done:
    description:
      - A C(done) count read earlier (for example before a restart). When given, C(making_progress)
        also requires C(done >= baseline_done + min_done_increase).
    type: int
  buckets:
    description:
      - Also read the run's buckets (issue 39) - the bucket count from C(run.json), the samples of each
        bucket from C(buckets.json) (written by the job), each bucket's done count from the index - and
        return C(bucket_count), C(bucket_done), C(bucket_totals), C(assign), C(finished_buckets),
        C(dataset_hash) and C(buckets_error).
        Costs a hash of every indexed id.
    type: bool
    default: false
seealso:
  - module: hsx.recovery.shard_verify
    description: Verifies the shards whose progress this module counts, and quarantines bad ones.
  - module: hsx.recovery.hsx_assignment
    description: The fleet's split into buckets, which takeover and rebalance move by what this module reads.
extends_documentation_fragment:
  - hsx.recovery.attributes
attributes:
  check_mode:
    support: full
    details: Reads only; runs the same in check mode.
  diff_mode:
    support: none
notes:
  - A status written on another host (shared storage) cannot have its process checked;
    C(pid_alive) is then null.
"""

EXAMPLES = r"""
- name: Read the extraction's progress
  extraction_status_info:
    path: /data/hsx/output
  register: progress

- name: Wait until the extraction is making progress
  extraction_status_info:
    path: /data/hsx/output
    progress_window: 60
  register: progress
  until: progress.making_progress
  retries: 30
  delay: 5
"""

RETURN = r"""
exists:
  description: Whether the output directory exists.
  type: bool
  returned: always
textfile:
  description:
    - The name of the node_exporter textfile a run on this output writes (C(hsx-<key>.prom), in the
      directory of its C(metrics_textfile_dir)); named from the path alone, also where nothing ran.
  type: str
  returned: always
  sample: hsx-3f2a9c0d1b4e.prom
  version_added: "0.3.0"
has_manifest:
  description: Whether C(run.json) exists (a run was started here).
  type: bool
  returned: always
state:
  description: The run state from status.json (running, done, paused, disk low, failed, interrupted), or C(none).
  type: str
  returned: always
done:
  description: Completed samples according to the index.
  type: int
  returned: always
total:
  description: Samples this run is assigned (from status.json), or null when unknown.
  type: int
  returned: always
remaining:
  description: total - done, or null.
  type: int
  returned: always
samples_per_s:
  description: The run's recent rate.
  type: float
  returned: always
eta_s:
  description: Seconds to completion at the current rate, or null.
  type: float
  returned: always
bytes_done:
  description: Bytes of indexed shards.
  type: int
  returned: always
bytes_per_sample:
  description: Mean indexed shard size, or null before the first shard.
  type: int
  returned: always
pid:
  description: Process id of the extraction that wrote status.json.
  type: int
  returned: always
pid_alive:
  description: Whether that process runs (null when it ran on another host).
  type: bool
  returned: always
status_age_s:
  description: Seconds since status.json was last updated.
  type: float
  returned: always
last_progress_age_s:
  description: Seconds since C(done) last grew, from the status history (null when unknown).
  type: float
  returned: always
making_progress:
  description: The process is alive, the state is running and done grew within I(progress_window).
  type: bool
  returned: always
message:
  description: The status message (for example why the run paused).
  type: str
  returned: always
index_bad_lines:
  description: Damaged index lines (not counting a torn last line).
  type: int
  returned: always
bucket_count:
  description: The run's bucket count (run.json), or null for a run without buckets or none yet.
  type: int
  returned: when I(buckets)
bucket_done:
  description: Bucket number (a string) -> samples of it in the index; buckets with none are left out.
  type: dict
  returned: when I(buckets)
bucket_totals:
  description: Samples in each bucket of the whole dataset (buckets.json), or null when the job has not written it.
  type: list
  elements: int
  returned: when I(buckets)
assign:
  description: The buckets the job last ran with (its --assign, from buckets.json), or null.
  type: str
  returned: when I(buckets)
finished_buckets:
  description: Buckets whose samples are all in the index (a range list; '' when none or the totals are unknown).
  type: str
  returned: when I(buckets)
dataset_hash:
  description:
    - The hash of the dataset file the run read (run.json's C(dataset_hash)), or null. C(hsx fleet-status) compares
      it between hosts (their copies of the dataset must be one).
  type: str
  returned: when I(buckets)
buckets_error:
  description:
    - Why the host's buckets are unknown (its index could not be read), or null. C(bucket_count) is then null and
      nothing is started or finished by this read; a rebalance or takeover counts the host as not answered.
  type: str
  returned: when I(buckets)
"""

import datetime
import os
import stat
import time
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.hsx.bucketcount import done_per_bucket, finished_buckets, read_bucket_totals
from ansible.module_utils.hsx.buckets import format_ranges
from ansible.module_utils.hsx.index import read_index
from ansible.module_utils.hsx.layout import MANIFEST_NAME
from ansible.module_utils.hsx.manifest import ManifestError, read_manifest_dict
from ansible.module_utils.hsx.status import pid_alive, read_status
from ansible.module_utils.hsx.textfile import textfile_name

ARGUMENT_SPEC = dict(
    path=dict(type="path", required=True, aliases=["output_dir"]),
    progress_window=dict(type="int", default=120),
    min_done_increase=dict(type="int", default=1),
    baseline_done=dict(type="int"),
    buckets=dict(type="bool", default=False),
)


def _parse_time(text: Any) -> float | None:
    try:
        return datetime.datetime.fromisoformat(str(text)).timestamp()
    except ValueError:
        return None


def last_progress_time(history: list[Any]) -> float | None:
    """When `done` last grew, from the (time, done) history status.json keeps."""
    points = [(float(t), int(d)) for t, d in history if isinstance(t, int | float)] if history else []
    for (_t_prev, d_prev), (t, d) in zip(reversed(points[:-1]), reversed(points), strict=False):
        if d > d_prev:
            return t
    return None


def _is_regular(path: str) -> bool:
    """A regular file at `path` itself (a link there is not followed: not run.json of ours)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


class ExtractionStatus:
    """Combines status.json and the index into the module's answer; pure and testable."""

    def __init__(self, output_dir: str, progress_window: int, baseline_done: int | None = None,
                 min_done_increase: int = 1, now: float | None = None):
        self.output_dir = output_dir
        self.progress_window = progress_window
        self.baseline_done = baseline_done
        self.min_done_increase = min_done_increase
        self.now = now if now is not None else time.time()
        self.index_ids: list[str] = []  # the indexed sample ids, once read() has read the index
        self.index_error: str | None = "the index was not read"  # why not (None: read, or no output at all)

    def read(self) -> dict[str, Any]:
        result: dict[str, Any] = {
            "exists": os.path.isdir(self.output_dir),
            "has_manifest": _is_regular(os.path.join(self.output_dir, MANIFEST_NAME)),
            "state": "none", "done": 0, "total": None, "remaining": None, "samples_per_s": 0.0,
            "eta_s": None, "bytes_done": 0, "bytes_per_sample": None, "pid": None, "pid_alive": False,
            "status_age_s": None, "last_progress_age_s": None, "making_progress": False, "message": "",
            "index_bad_lines": 0, "textfile": textfile_name(self.output_dir),
        }
        if not result["exists"]:
            result["message"] = f"{self.output_dir} does not exist"
            self.index_error = None  # nothing run here: nothing started, nothing finished
            return result
        try:
            index = read_index(self.output_dir)
        except OSError as e:  # a link or a FIFO at index.jsonl (never followed nor waited on), a read error
            result["message"] = self.index_error = f"unreadable index: {e}"
            return result
        self.index_error = None
        self.index_ids = list(index.entries)
        result["done"] = len(index.entries)
        result["index_bad_lines"] = index.bad_lines
        result["bytes_done"] = sum(e.size for e in index.entries.values())
        if index.entries:
            result["bytes_per_sample"] = result["bytes_done"] // len(index.entries)
        try:
            status = read_status(self.output_dir)
        except FileNotFoundError:
            result["message"] = "no readable status.json (the extraction has not run here yet)"
            return result
        except (OSError, ValueError) as e:  # hsx.status says what is wrong with the file
            result["message"] = f"no readable status.json: {e}"
            return result
        total = status.get("total")
        result.update(
            state=str(status.get("state", "none")), total=total, message=str(status.get("message") or ""),
            samples_per_s=float(status.get("samples_per_s") or 0.0), eta_s=status.get("eta_s"),
            pid=status.get("pid"), pid_alive=pid_alive(status.get("pid"), status.get("host")),
        )
        if isinstance(total, int):
            result["remaining"] = max(total - result["done"], 0)
        updated = _parse_time(status.get("updated_at"))
        if updated is not None:
            result["status_age_s"] = round(self.now - updated, 1)
        progressed = last_progress_time(status.get("history") or [])
        if progressed is not None:
            result["last_progress_age_s"] = round(self.now - progressed, 1)
        result["making_progress"] = self._making_progress(result)
        return result

    def read_buckets(self) -> dict[str, Any]:
        """The per-bucket keys (module option `buckets`) from run.json, buckets.json and the index
        `read` loaded; nothing is counted finished without the job's own totals. When `read` could not
        read the index, which buckets are started or finished is unknown: bucket_count is None and
        buckets_error says why (a rebalance or takeover counts the host as not answered)."""
        out: dict[str, Any] = {"bucket_count": None, "bucket_done": {}, "bucket_totals": None, "assign": None,
                               "finished_buckets": "", "dataset_hash": None, "buckets_error": self.index_error}
        if self.index_error is not None:
            return out
        try:
            manifest = read_manifest_dict(self.output_dir)
        except ManifestError:
            return out
        count = manifest.get("buckets")
        if isinstance(manifest.get("dataset_hash"), str):
            out["dataset_hash"] = manifest["dataset_hash"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            return out
        done = done_per_bucket(self.index_ids, count)
        out.update(bucket_count=count, bucket_done={str(b): n for b, n in sorted(done.items())})
        recorded = read_bucket_totals(self.output_dir)
        if recorded is not None and recorded["buckets"] == count:
            out.update(bucket_totals=recorded["totals"], assign=recorded["assign"],
                       finished_buckets=format_ranges(finished_buckets(done, recorded["totals"])))
        return out

    def _making_progress(self, r: dict[str, Any]) -> bool:
        if r["state"] != "running" or r["pid_alive"] is False:
            return False
        recent = r["last_progress_age_s"] is not None and r["last_progress_age_s"] <= self.progress_window
        if self.baseline_done is not None:
            return recent and r["done"] >= self.baseline_done + self.min_done_increase
        return recent


class ExtractionStatusModule:
    """The module: reads the output with the task's arguments; changes nothing, also outside check mode."""

    def __init__(self, module: AnsibleModule):
        self.module = module
        self.params = module.params

    def run(self) -> dict[str, Any]:
        p = self.params
        status = ExtractionStatus(p["path"], p["progress_window"], p["baseline_done"], p["min_done_increase"])
        result = status.read()
        if p.get("buckets"):
            result.update(status.read_buckets())
        return dict(result, changed=False)


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    module.exit_json(**ExtractionStatusModule(module).run())


if __name__ == "__main__":
    main()
