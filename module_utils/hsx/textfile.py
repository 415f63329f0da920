"""The name of a run's node_exporter textfile: one file per output directory.

The runner writes `DIR/hsx-<key>.prom` (extraction/runner/metrics.py); roles/extraction_job removes
the one of an output the host's job has left (its last state would otherwise stay "running" for ever:
a stale alert the self-healing loop would act on). Both name it here.
"""

from __future__ import annotations

import hashlib
import os

TEXTFILE_PREFIX = "hsx-"


def textfile_key(output_dir: str) -> str:
    """The per-output name part: 12 hex of the sha256 of the output's absolute path (its bytes)."""
    return hashlib.sha256(os.fsencode(os.path.abspath(output_dir))).hexdigest()[:12]


def textfile_name(output_dir: str) -> str:
    """`hsx-<key>.prom`: the file a run on `output_dir` writes into the textfile directory."""
    return f"{TEXTFILE_PREFIX}{textfile_key(output_dir)}.prom"
