"""The `full` and `deep` levels over a whole output directory: every listed shard checked, in batches.

`full` over big shards is CRC32 and pread, which release the GIL: it runs in threads. Other
mixes (deep, full on small files) run in a process pool, which balances batches of unequal cost.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import ziprecords
from ..index import IndexEntry, entry_problems, replay_index
from ..manifest import ManifestError, check_fingerprints
from .check import Expect, ShardInfo, check_batch
from .report import BadShard, VerifyReport
from .scan import list_shards


def verify_full(
    output_dir: str,
    expect: Expect,
    lines: list[bytes],
    report: VerifyReport,
    level: str,
    workers: int,
    deep_check: Callable[[str, Expect, ShardInfo], str | None] | None,
    progress: Callable[[int, int, int], None] | None,
) -> tuple[list[tuple[str, str, str]], dict[str, str]]:
    """verify_output for `full` and `deep` from the index's lines: (problems, path -> sample id),
    the report's counts and lists filled."""
    state = replay_index(lines)
    report.index_bad_lines = state.bad_lines
    # Before any check, and so before anything moves: data of another run.json is refused whole.
    check_fingerprints(output_dir, expect.fingerprint, (e.fingerprint for e in state.entries.values()))
    try:
        on_disk = list_shards(output_dir, report.orphans)
    except PermissionError as e:
        raise ManifestError(f"{e.filename}: cannot list: {e.strerror}") from None

    disk_set = set(on_disk)
    by_path: dict[str, IndexEntry] = {}
    untrusted = entry_problems((sid, e.path) for sid, e in state.entries.items())
    for sid, entry in sorted(state.entries.items()):
        if (why := untrusted.get(sid)) is not None:
            report.bad.append(BadShard(sid, entry.path, why))
        elif entry.path not in disk_set:
            report.missing.append(sid)
        else:
            by_path[entry.path] = entry
    report.unindexed = [p for p in on_disk if p not in by_path]
    jobs = [(p, by_path.get(p)) for p in on_disk]

    problems: list[tuple[str, str, str]] = []

    def add(part: tuple[int, int, int, list[tuple[str, str, str]]]) -> None:
        report.checked += part[0]
        report.ok += part[1]
        report.bytes += part[2]
        problems.extend(part[3])
        if progress:
            progress(report.checked, len(jobs), report.bytes)

    batch = max(1, min(256, len(jobs) // max(1, workers * 8) or 1))
    batches = [jobs[i : i + batch] for i in range(0, len(jobs), batch)]
    # `full` over big shards is CRC32 and pread, which run with the GIL released: threads share
    # them at no start-up cost. Other mixes (deep, full on small files): a process pool,
    # balancing batches of unequal cost; it costs ~0.1 s to start.
    sizes = [e.size for e in by_path.values()]
    threads = level == "full" and bool(sizes) and sum(sizes) >= len(sizes) * ziprecords.SMALL_FILE
    if workers > 1 and len(jobs) >= 2 * workers and threads:
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(max_workers=workers) as tpool:
            futures = [tpool.submit(check_batch, output_dir, b, level, expect, deep_check) for b in batches]
            for fut in cf.as_completed(futures):
                add(fut.result())
    elif workers > 1 and len(batches) > 1 and len(jobs) >= 4 * workers and level != "quick":
        import concurrent.futures as cf
        import multiprocessing as mp

        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
        with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            futures = [pool.submit(check_batch, output_dir, b, level, expect, deep_check) for b in batches]
            for fut in cf.as_completed(futures):
                add(fut.result())
    else:
        for b in batches:
            add(check_batch(output_dir, b, level, expect, deep_check))

    return problems, {p: e.sample_id for p, e in by_path.items()}
