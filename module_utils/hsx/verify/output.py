"""verify_output: every shard of a run verified at one level, reconciled with the index, acted on."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ..fsutil import LinkRefused
from ..index import read_index_lines
from ..layout import INDEX_NAME, MANIFEST_NAME
from ..manifest import ManifestError, read_manifest_dict
from .check import LEVELS, Expect, ShardInfo
from .full import verify_full
from .quick import verify_quick
from .report import VerifyReport, add_problems, finish


def verify_output(
    output_dir: str,
    level: str = "quick",
    *,
    quarantine: bool = False,
    check_mode: bool = False,
    workers: int = 1,
    deep_check: Callable[[str, Expect, ShardInfo], str | None] | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    orphan_min_age: float = 600.0,
) -> VerifyReport:
    """Verify every shard of a run, reconcile with the index, and (if asked) quarantine.

    With quarantine and not check_mode: bad shards move to quarantine/ with a reason file,
    index tombstones make bad and missing samples "not done", and writer temps older than
    orphan_min_age seconds are deleted (younger ones may belong to a live writer). Nothing
    moves when any file could not be read (report.errors) - an I/O problem is not bad data.
    Raises ManifestError when output_dir is not a run.
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")
    if level == "deep" and deep_check is None:
        raise ValueError("level 'deep' needs a deep_check (it loads tensors with torch)")
    started = time.monotonic()
    if not os.path.isdir(output_dir):
        raise ManifestError(f"{output_dir}: not a directory")
    expect = Expect.from_manifest(read_manifest_dict(output_dir), os.path.join(output_dir, MANIFEST_NAME))
    report = VerifyReport(level=level)
    try:
        lines = read_index_lines(output_dir)
    except PermissionError as e:
        raise ManifestError(f"{os.path.join(output_dir, INDEX_NAME)}: cannot read: {e.strerror}") from None
    except LinkRefused as e:  # a link or a FIFO at index.jsonl: never followed, never waited on
        raise ManifestError(str(e)) from None
    if level == "quick":
        problems, rows = verify_quick(output_dir, expect, lines, report, workers, progress)
        add_problems(report, problems, {p[0]: rows[p[0]][0] for p in problems if p[0] in rows})
    else:
        problems, ids = verify_full(output_dir, expect, lines, report, level, workers, deep_check, progress)
        add_problems(report, problems, ids)
    return finish(report, output_dir, level, quarantine, check_mode, orphan_min_age, started)
