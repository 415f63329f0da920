"""`quick` in several processes: the shards split by size, handed out in chunks to forked workers.

Each size's layout is learnt by one worker only (split_by_size), chunks go out one at a time so
that all workers end together (Chunks), and the folders are listed here while the workers check
what the index names; the listing then has the last word (quick_split).
"""

from __future__ import annotations

import os
import struct
from typing import Any

from .. import ziprecords
from ..cores import usable_cores
from ..index import IndexRow
from ..layout import BUCKET_HEX_CHARS, SHARDS_DIR
from .check import Expect
from .pool import fork_map
from .quick_worker import DIR_OPEN_FLAGS, HAVE_DIR_FD, JOB_SIZE, MAX_DIR_FDS, QuickWorker

# List the folders while the forked workers check (True), before (False), or None: alongside when
# the workers leave a core free (quick_split).
_LIST_ALONGSIDE: bool | None = None
# Full checks after the listing (no index entry, not a regular file) are forked from this many.
_FORK_MIN_REDO = 256

_LEARN_WEIGHT = 24  # a size's first shard (full check, layout learnt) costs ~this many fast-path shards
_SLOW_WEIGHT = 24  # a shard without a fast path (no index entry, or too big): a full check


def split_by_size(jobs: list, n: int) -> list[list]:
    """Jobs sorted by size cut into n contiguous shares of about equal cost, never inside a
    size's group (so each size's layout is learnt by one worker only, once per verification).
    Size 0 (no fast path: each job a full check) is cut anywhere: on real, large shards it is
    every job.
    """
    costs = []
    for i, job in enumerate(jobs):
        if job[0] == 0:
            costs.append(_SLOW_WEIGHT)
        else:
            costs.append(1 + (_LEARN_WEIGHT if i == 0 or jobs[i - 1][0] != job[0] else 0))
    total = sum(costs)
    shares: list[list] = []
    start = acc = 0
    for i, cost in enumerate(costs):
        if len(shares) == n - 1:
            break
        if acc >= total * (len(shares) + 1) / n and (jobs[i][0] == 0 or jobs[i][0] != jobs[i - 1][0]):
            shares.append(jobs[start:i])
            start = i
        acc += cost
    shares.append(jobs[start:])
    return shares + [[] for _i in range(n - len(shares))]


_CHUNKS_PER_WORKER = 4
_CHUNK_ID = struct.Struct("<H")


class Chunks:
    """Jobs cut by size (split_by_size) into a few chunks per worker, handed out one at a time
    through a pipe filled and closed for writing before the fork: a worker that runs slower (its
    hyperthread sibling busy, forked later, or the parent listing first) takes fewer, so all end
    together. A read of 2 bytes from the pipe is one chunk id, whole; an empty read: all taken.
    """

    def __init__(self, jobs: list, workers: int):
        self.chunks = [c for c in split_by_size(jobs, min(workers * _CHUNKS_PER_WORKER, 0xFFFF)) if c]
        r, w = os.pipe()
        try:
            data = b"".join(map(_CHUNK_ID.pack, range(len(self.chunks))))
            while data:  # a few hundred bytes at most: far below a pipe's capacity
                data = data[os.write(w, data) :]
        finally:
            os.close(w)
        self.fd = r

    def check(self, lister: QuickWorker) -> tuple:
        """Check chunks until none is left (in whichever process calls it); the checks' result."""
        worker = QuickWorker(lister.output_dir, lister.buckets, lister.expect, lister.by_path)
        while len(got := os.read(self.fd, _CHUNK_ID.size)) == _CHUNK_ID.size:
            worker.check(self.chunks[_CHUNK_ID.unpack(got)[0]], None)
        return worker.result()

    def close(self) -> None:
        os.close(self.fd)


def quick_split(
    output_dir: str, buckets: list[str], expect: Expect, by_path: dict[str, IndexRow], n: int, reap: list[int]
) -> list[tuple]:
    """`quick` in n forked workers, split by size, each size's layout learnt by one worker
    instead of by every worker (learning is most of a first verification's cost when shards
    are small, and runs have thousands of lengths). Returns QuickWorker.result() tuples.

    The workers check the shards the index names, opened relative to their folders (opened here
    before the fork), while this process lists the folders and then joins them (Chunks), so
    the listing is no longer ahead of every check - when a core is left for it (n < usable
    cores, or _LIST_ALONGSIDE; otherwise it runs first: docs/benchmarks.md). The listing then
    reconciles (_reconcile): a shard it did not find is missing (whatever a worker made of it),
    one that is not a regular file per the listing, or not in the index, gets the full check
    here. When a folder cannot be opened, everything is listed first (_quick_split_listed),
    which reports the folder as before.
    """
    lister = QuickWorker(output_dir, buckets, expect, by_path)
    opened: dict[str, int] = {}
    try:
        alongside = _LIST_ALONGSIDE if _LIST_ALONGSIDE is not None else n < usable_cores()
        if not alongside or len(buckets) > MAX_DIR_FDS or not HAVE_DIR_FD:
            return _quick_split_listed(lister, n, reap)
        root = os.path.join(output_dir, SHARDS_DIR)
        for b in buckets:
            try:
                opened[b] = os.open(os.path.join(root, b), DIR_OPEN_FLAGS)
            except OSError:
                return _quick_split_listed(lister, n, reap)
        jobs = _indexed_jobs(by_path, opened)
        chunks = Chunks(jobs, n)
        try:
            parts = fork_map(
                _quick_part,
                [("list", lister, opened, chunks), *[("check", lister, opened, chunks)] * n],
                reap,
            )
        finally:
            chunks.close()
        listed, own = parts[0]
        return _reconcile(lister, listed, [own, *parts[1:]], jobs, n, reap)
    finally:
        for fd in opened.values():
            os.close(fd)


def _quick_split_listed(lister: QuickWorker, n: int, reap: list[int]) -> list[tuple]:
    """List every folder here, then check the listed shards in n processes split by size."""
    fds: list[int] = []
    try:
        jobs = lister.list(range(len(lister.buckets)), fds)
        if jobs is None:
            return [lister.result()]
        parts = _check_in_chunks(lister, jobs, n, reap)
    finally:
        for fd in fds:
            os.close(fd)
    return [lister.result(), *parts]


def _check_in_chunks(lister: QuickWorker, jobs: list, n: int, reap: list[int]) -> list[tuple]:
    """Check `jobs` in n processes (this one and n - 1 forked) taking chunks of sizes (Chunks)."""
    chunks = Chunks(jobs, n)
    try:
        return fork_map(Chunks.check, [(chunks, lister)] * n, reap)
    finally:
        chunks.close()


def _indexed_jobs(by_path: dict[str, IndexRow], opened: dict[str, int]) -> list:
    """The index's shards as jobs (sorted by size), each opened relative to its open folder;
    a shard whose folder is not there is not a job (the listing reports it missing)."""
    start = len(SHARDS_DIR) + 1
    end = start + BUCKET_HEX_CHARS
    small = ziprecords.SMALL_FILE
    jobs = []
    append = jobs.append
    for rel, row in by_path.items():  # rel matched SHARD_RELPATH_RE: shards/<bucket>/<name>.pt
        fd = opened.get(rel[start:end])
        if fd is not None:
            append((row[2] if 0 < row[2] <= small else 0, rel[end + 1 :], fd, rel, row, True))
    if "\0" in (names := "".join(by_path)) or not _encodable(names):  # a made-up index: no such file
        jobs = [job for job in jobs if "\0" not in job[3] and _encodable(job[3])]
    jobs.sort(key=JOB_SIZE)
    return jobs


def _encodable(name: str) -> bool:
    """The name can be a path here (a lone surrogate in a hand-made index cannot)."""
    try:
        os.fsencode(name)
    except UnicodeError:
        return False
    return True


def _quick_part(kind: str, lister: QuickWorker, opened: dict[str, int], chunks: Chunks) -> Any:
    """quick_split's work for fork_map: "list" (here) the open folders, then check chunks of
    the index's jobs like the workers: (listing, checks); "check" (a forked worker): checks."""
    if kind == "list":
        return lister.list(range(len(lister.buckets)), [], opened), chunks.check(lister)
    return chunks.check(lister)


def _reconcile(
    lister: QuickWorker, listed: list | None, checked: list[tuple], jobs: list, n: int, reap: list[int]
) -> list[tuple]:
    """The workers' verdicts, corrected by the listing: a shard the listing did not find is
    missing (its verdict dropped); one it says is not a regular file, or that has no index
    entry, gets the full check now (in n workers when there are many)."""
    if listed is None:  # a folder could not be listed: quick.merge_quick reports it
        return [lister.result()]
    parts = [list(p) for p in checked]
    irregular = [job for job in listed if job[4] is not None and not job[5]]
    drop = {job[3] for job in irregular}
    if len(lister.files) - len(lister.unindexed) != len(lister.by_path):
        drop |= lister.by_path.keys() - set(lister.files)
    if drop and parts:
        judged = {job[3] for job in jobs} & drop  # checked by a worker: one verdict each
        for p in parts:
            bad = {problem[0] for problem in p[3]}
            p[3] = [problem for problem in p[3] if problem[0] not in drop]
            judged -= bad & drop
        parts[0][1] -= len(judged)  # passed: counted ok, with the bytes a quick pass counts
        parts[0][2] -= sum(
            size for rel in judged if (size := lister.by_path[rel][2]) <= ziprecords.SMALL_FILE
        )
    redo = sorted((job for job in listed if job[4] is None or not job[5]), key=JOB_SIZE)
    if redo:
        parts += _check_in_chunks(lister, redo, n if len(redo) >= _FORK_MIN_REDO else 1, reap)
    return [lister.result(), *map(tuple, parts)]
