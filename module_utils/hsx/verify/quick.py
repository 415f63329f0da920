"""The `quick` level over a whole output directory: the index's entries against the listed shards."""

from __future__ import annotations

import os
from collections.abc import Callable

from ..index import IndexRow, entry_problems, index_rows, replay_index
from ..layout import are_shard_relpaths
from ..manifest import ManifestError, check_fingerprints
from .check import Expect
from .pool import reap
from .quick_split import quick_split
from .quick_worker import QuickWorker
from .report import BadShard, VerifyReport
from .scan import list_buckets

_FORK_MIN_QUICK = 1000  # below this many files a `quick` run is faster than forking workers


def verify_quick(
    output_dir: str,
    expect: Expect,
    lines: list[bytes],
    report: VerifyReport,
    workers: int,
    progress: Callable[[int, int, int], None] | None,
) -> tuple[list[tuple[str, str, str]], dict[str, IndexRow]]:
    """verify_output for `quick` from the index's lines: (problems, by_path), the report filled.

    One process lists every bucket folder (QuickWorker.list); with workers > 1 the shards are
    then checked by forked workers, split by size (quick_split). Verdicts, reasons and every
    list in the report are those scan.list_shards + check.check_batch give, in the same order.
    """
    entries = index_rows(lines)
    by_path: dict[str, IndexRow] = {}
    if entries is not None:  # every line good: the checks below in one pass each
        paths = [row[1] for row in entries.values()]
        # Each entry at its sample's own shard path: entry_problems finds nothing (no path
        # outside shards/, and no two alike: a sample's shard path is its own).
        if are_shard_relpaths(list(entries), paths):
            by_path = dict(zip(paths, entries.values(), strict=True))
        else:
            entries = None
    if entries is None:
        state = replay_index(lines)
        report.index_bad_lines = state.bad_lines
        entries = {}
        untrusted = entry_problems((sid, e.path) for sid, e in state.entries.items())
        for sid, entry in sorted(state.entries.items()):
            why = untrusted.get(sid)
            if why is not None:
                report.bad.append(BadShard(sid, entry.path, why))
            else:
                row = (sid, entry.path, entry.size, entry.checksum, entry.num_tokens, entry.fingerprint)
                entries[sid] = by_path[entry.path] = row
        fingerprints = [e.fingerprint for e in state.entries.values()]
    else:  # every live entry is a row (5 fields before the fingerprint, 6 with it)
        fingerprints = [row[5] if len(row) > 5 else None for row in entries.values()]
    # Before any check, and so before anything moves: data of another run.json is refused whole.
    check_fingerprints(output_dir, expect.fingerprint, fingerprints)
    try:
        buckets = list_buckets(output_dir, report.orphans)
    except PermissionError as e:
        raise ManifestError(f"{e.filename}: cannot list: {e.strerror}") from None
    n = min(workers, len(buckets))
    reap_later: list[int] = []  # forked workers done but maybe still exiting: collected below
    try:
        if n > 1 and len(entries) >= _FORK_MIN_QUICK and hasattr(os, "fork"):
            parts = quick_split(output_dir, buckets, expect, by_path, n, reap_later)
            live = progress
        else:
            parts = [QuickWorker(output_dir, buckets, expect, by_path).run(range(len(buckets)), progress)]
            live = None  # progress was reported while checking
        problems = merge_quick(report, parts, by_path, entries, live)
    finally:
        reap(reap_later)
    return problems, by_path


def merge_quick(
    report: VerifyReport,
    parts: list[tuple],
    by_path: dict[str, IndexRow],
    entries: dict[str, IndexRow],
    progress: Callable[[int, int, int], None] | None,
) -> list[tuple[str, str, str]]:
    """The workers' results into the report: counts, orphans, missing and unindexed shards."""
    failed = [p[6] for p in parts if p[6] is not None]
    if failed:
        e = min(failed, key=lambda f: f[0])[1]
        if isinstance(e, PermissionError):
            raise ManifestError(f"{e.filename}: cannot list: {e.strerror}") from None
        raise e
    total = sum(len(p[0]) for p in parts)
    problems: list[tuple[str, str, str]] = []
    found = 0
    for files, ok, nbytes, part_problems, orphans, unindexed, _extra in parts:
        report.checked += len(files)
        report.ok += ok
        report.bytes += nbytes
        problems.extend(part_problems)
        report.orphans.extend(orphans)
        report.unindexed.extend(unindexed)
        found += len(files) - len(unindexed)
        if progress:
            progress(report.checked, total, report.bytes)
    report.orphans.sort()
    report.unindexed.sort()
    if found != len(by_path):  # some indexed shards are not on disk: which (by sample id)
        gone = by_path.keys() - {rel for p in parts for rel in p[0]}
        report.missing = sorted(sid for sid, row in entries.items() if row[1] in gone)
    return problems
