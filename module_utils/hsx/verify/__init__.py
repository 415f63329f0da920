"""The shard verifier: `quick` (structure), `full` (+ CRC32) and `deep` (+ values, torch, plugged in).

verify_output checks every shard of a run at one level, reconciles the files with the index, and
on request quarantines what is bad; check_shard is the verdict on one file. Modules:

- check: one shard (Expect, check_shard, the layout memo)
- quick, quick_worker, quick_split: `quick` over a directory, in one process or forked workers
- full: `full` and `deep` over a directory, in threads or a process pool
- pool: the fork map `quick` uses; scan: listing; report: VerifyReport and quarantine
- output: verify_output
"""

from __future__ import annotations

from ..cores import default_workers
from ..manifest import ManifestError
from .check import LEVELS, Expect, ShardInfo, check_shard
from .output import verify_output
from .report import BadShard, VerifyReport

__all__ = [
    "LEVELS",
    "BadShard",
    "Expect",
    "ManifestError",
    "ShardInfo",
    "VerifyReport",
    "check_shard",
    "default_workers",
    "verify_output",
]
