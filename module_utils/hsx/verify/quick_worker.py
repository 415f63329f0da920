"""`quick` over bucket folders in one process: list them, then check their shards (QuickWorker)."""

from __future__ import annotations

import itertools
import operator
import os
import stat
from collections.abc import Callable, Iterable

from .. import ziprecords
from ..errors import ShardBad
from ..index import IndexEntry, IndexRow
from ..layout import SHARD_SUFFIX, SHARDS_DIR, TEMP_PREFIX, is_temp_name
from .check import OPEN_FLAGS, Expect, check_batch, inspect_shard, known_layouts

_FAST_OPEN = OPEN_FLAGS | getattr(os, "O_CLOEXEC", 0)
# How a bucket folder is opened for the workers to open its shards relative to it (never a symlink).
DIR_OPEN_FLAGS = (
    os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
)
# Shards can be opened relative to an open folder, and a folder listed through its fd.
HAVE_DIR_FD = os.open in os.supports_dir_fd and os.scandir in os.supports_fd
JOB_SIZE = operator.itemgetter(0)  # a job's indexed size: jobs are sorted and split by it
_ROW_TOKENS = operator.itemgetter(4)
MAX_DIR_FDS = 512  # bucket folders a quick worker keeps open (more are opened by path)


class QuickWorker:
    """`quick` over bucket folders: list them (list), check their shards (check) - both in one
    process, or the listing here and the checking in chunks of sizes taken by forked workers
    (quick_split.quick_split, quick_split.Chunks).

    The fast path, for a shard of a layout already seen (check.ShardLayout) whose index entry gives its
    size: the listing's d_type says it is a regular file; open it relative to its folder
    (O_NOFOLLOW: never through a symlink; O_NONBLOCK: a FIFO swapped in cannot block), one pread
    of one byte more than the index says, close: three system calls, no fstat. A pread returns
    less than asked only at the end of the file, so reading exactly the indexed size means the
    file has that size, as fstat would have said (a directory or FIFO swapped in fails the read).
    Those bytes matching a known layout, with the indexed token count, is check_shard's own fast
    path, so the shard passes. Anything else (no entry, no known layout of that size, not a
    regular file per the listing, an open or read error, another length, other bytes or token
    count) goes to check_shard as before, which gives the verdict and its reason itself (and
    learns the layout of a small shard that passes).
    """

    def __init__(self, output_dir: str, buckets: list[str], expect: Expect, by_path: dict[str, IndexRow]):
        self.output_dir = output_dir
        self.root = output_dir.rstrip("/") + "/" if output_dir else ""
        self.buckets, self.expect, self.by_path = buckets, expect, by_path
        self.files: list[str] = []  # every shard-named entry listed (relative paths)
        self.ok = self.nbytes = 0
        self.problems: list[tuple[str, str, str]] = []
        self.orphans: list[str] = []
        self.unindexed: list[str] = []  # shards with no index entry
        self.error: tuple[int, OSError] | None = None  # the first folder that could not be listed

    def run(self, take: Iterable[int], progress: Callable[[int, int, int], None] | None = None) -> tuple:
        """List the folders `take` names, then check their shards (one process, no split)."""
        fds: list[int] = []
        try:
            jobs = self.list(take, fds)
            if jobs is not None:
                self.check(jobs, progress)
        finally:
            for fd in fds:
                os.close(fd)
        return self.result()

    def list(self, take: Iterable[int], fds: list[int], opened: dict[str, int] | None = None) -> list | None:
        """The shards of the folders `take` names as jobs in order of indexed size; None when a
        folder could not be listed (self.error says which). Folder fds opened go into `fds`;
        `opened` gives folders already open (bucket -> fd, closed by the caller).

        Shards of one size share a layout: checked one after another, its bytes stay in the
        CPU's cache instead of being fetched again for every file (runs have ~2k lengths).
        """
        jobs: list[tuple[int, str, int | None, str, IndexRow | None, bool]] = []
        for i in take:
            try:
                self._list(i, fds, jobs, (opened or {}).get(self.buckets[i]))
            except OSError as e:
                self.error = (i, e)
                return None
        jobs.sort(key=JOB_SIZE)
        return jobs

    def result(self) -> tuple:
        return self.files, self.ok, self.nbytes, self.problems, self.orphans, self.unindexed, self.error

    def _list(self, i: int, fds: list[int], jobs: list, fd: int | None = None) -> None:
        """List folder i (through `fd` when it is open already): its shards become jobs
        (indexed size, path to open, folder fd, rel, row, regular)."""
        path = os.path.join(self.output_dir, SHARDS_DIR, self.buckets[i])
        prefix = f"{SHARDS_DIR}/{self.buckets[i]}/"
        if fd is not None:
            with os.scandir(fd) as it:
                entries = list(it)
        elif HAVE_DIR_FD and len(fds) < MAX_DIR_FDS:
            try:
                fd = os.open(path, DIR_OPEN_FLAGS)
            except OSError:
                fd = None  # listed by name below, which fails (or not) as it always did
            if fd is not None:
                try:
                    with os.scandir(fd) as it:
                        entries = list(it)
                except OSError:
                    os.close(fd)
                    fd = None
                else:
                    fds.append(fd)
        if fd is None:
            with os.scandir(path) as it:
                entries = list(it)
        base = "" if fd is not None else self.root + prefix
        append, get, files = jobs.append, self.by_path.get, self.files
        suffix, temp, small = SHARD_SUFFIX, TEMP_PREFIX, ziprecords.SMALL_FILE
        for e in entries:
            name = e.name
            if not name.endswith(suffix) or name.startswith(temp):
                if is_temp_name(name) and self._is_file(e, prefix):
                    self.orphans.append(prefix + name)
                continue
            rel = prefix + name
            files.append(rel)
            row = get(rel)
            if row is None:
                self.unindexed.append(rel)
                size = 0
            else:
                size = row[2] if 0 < row[2] <= small else 0
            try:
                regular = e.is_file(follow_symlinks=False)  # d_type: no system call
            except OSError:
                regular = False
            append((size, base + name, fd, rel, row, regular))

    def check(self, jobs: list, progress: Callable[[int, int, int], None] | None) -> None:
        """The jobs (sorted by size) one size at a time (_check_size), progress every 256 shards."""
        total, done = len(jobs), 0
        for size, same in itertools.groupby(jobs, JOB_SIZE):
            group = list(same)
            self._check_size(size, group)
            done += len(group)
            if progress and (done - len(group)) >> 8 != done >> 8:
                progress(done, total, self.nbytes)
        if progress:
            progress(total, total, self.nbytes)

    def _check_size(self, size: int, group: list) -> None:
        """Shards of one indexed size: read them all, then compare them with the layout known for
        that size in C-level passes (map), so a shard costs little Python beyond its three system
        calls. With no layout known yet, the first shard that passes the full structure check on
        the bytes already read teaches it (_learn). A shard that fails any of it goes to _slow for
        its verdict and reason.
        """
        if not size:  # no indexed size, or too big for one read: each gets the full check
            for job in group:
                self._slow(job[3], job[4])
            return
        # The listing says something else than a regular file: never opened here.
        if not all(job[5] for job in group):
            for job in group:
                if not job[5]:
                    self._slow(job[3], job[4])
            group = [job for job in group if job[5]]
            if not group:
                return
        columns = list(zip(*group, strict=True))
        paths, dir_fds, rows = columns[1], columns[2], columns[4]
        datas = read_files(paths, dir_fds, size + 1)  # +1: a longer file reads longer and fails the compare
        start = 0
        while not known_layouts(size, self.expect) and start < len(group):
            if not self._learn(datas[start], rows[start], size):
                self._slow(group[start][3], rows[start])
            start += 1
        if start:
            group, datas, rows = group[start:], datas[start:], rows[start:]
            if not group:
                return
        known = known_layouts(size, self.expect)
        layout = known[0]
        matched = list(map(layout.fingerprint.__eq__, map(layout.get, datas)))  # length, too: see ShardLayout
        tokens = list(map(layout.info.num_tokens.__eq__, map(_ROW_TOKENS, rows)))
        if all(matched) and all(tokens):
            self.ok += len(group)
            self.nbytes += size * len(group)
            return
        for job, data, match, token in zip(group, datas, matched, tokens, strict=True):
            if not match:
                other = next((lo for lo in known[1:] if lo.get(data) == lo.fingerprint), None)
                match, token = other is not None, other is not None and other.info.num_tokens == job[4][4]
            if match and token:
                self.ok += 1
                self.nbytes += size
            else:
                self._slow(job[3], job[4])

    def _learn(self, data: bytes, row: IndexRow, size: int) -> bool:
        """check_shard's quick verdict on bytes already read, when it is a pass: the whole file
        (a regular file per the listing; exactly the indexed size, since the read asked for one
        byte more), the structure check (inspect_shard, which remembers the layout) and the
        indexed token count. False for anything else: _slow then gives the verdict and reason.
        """
        if len(data) != size:
            return False
        try:
            info = inspect_shard(-1, self.expect, size, data)
        except ShardBad:
            return False
        if info.num_tokens != row[4]:
            return False
        self.ok += 1
        self.nbytes += size
        return True

    def _is_file(self, e: os.DirEntry, prefix: str) -> bool:
        """e.is_file(follow_symlinks=False), failing with the path scan.list_shards would name."""
        try:
            return e.is_file(follow_symlinks=False)
        except OSError:
            try:
                return stat.S_ISREG(os.lstat(self.root + prefix + e.name).st_mode)
            except FileNotFoundError:
                return False

    def _slow(self, rel: str, row: IndexRow | None) -> None:
        """check_shard on one file, through check_batch (its verdict and reason)."""
        entry = IndexEntry(*row) if row is not None else None
        ok, nbytes, problems = check_batch(self.output_dir, [(rel, entry)], "quick", self.expect, None)[1:]
        self.ok += ok
        self.nbytes += nbytes
        self.problems.extend(problems)


def read_files(paths: Iterable[str], dir_fds: Iterable[int | None], want: int) -> list[bytes]:
    """The first `want` bytes of each file (opened relative to its folder's fd, never through a
    symlink, never blocking); b"" for one that cannot be opened or read (the full check says why).
    """
    out: list[bytes] = []
    append = out.append
    op, pread, close, flags = os.open, os.pread, os.close, _FAST_OPEN
    pairs = zip(paths, dir_fds, strict=True)
    done = False
    while not done:
        try:
            for path, dir_fd in pairs:
                f = op(path, flags, dir_fd=dir_fd)
                try:
                    data = pread(f, want, 0)
                finally:
                    close(f)
                append(data)
            done = True
        except OSError:  # this file only; the loop goes on with the next
            append(b"")
    return out
