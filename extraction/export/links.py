"""The links of an export view: their names, how one is made safely, and bringing DEST in line.

Names are SpecForge's own (`rows_{g}-{g + group_size}/data_{i}.ckpt`, see extraction.export.view).
A link is made at a temp name and renamed into place, so a reader never sees a half-made one and
a crash leaves at worst a temp that the next run's sweep removes.

Nothing below DEST, or below an output, is followed (hsx.fsutil): DEST's group folders are opened
without following a link (one that is a link is refused, naming it, or, if no number needs it,
reported as unknown and left alone), links are made, renamed and removed relative to those
folders' fds, and a shard is looked at (and hard-linked) relative to its folder in the output,
opened the same way. DEST itself, like OUTPUT, is the operator's path.

Symlinks are absolute: DEST usually lives on the training side (another directory tree, often
another filesystem), so a relative link would break whenever either tree is moved or mounted
elsewhere; an absolute one breaks only when OUTPUT moves, and a re-run with the new OUTPUT path
re-points every link without renumbering.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from typing import TYPE_CHECKING

from extraction.export.mapping import MAPPING_NAME, META_NAME, ExportError, MappingRecord
from hsx.fsutil import LinkRefused, open_dir_nofollow
from hsx.layout import is_temp_name, temp_name

if TYPE_CHECKING:
    from extraction.export.report import ExportReport

LOCK_NAME = ".hsx-export.lock"
DEFAULT_GROUP_SIZE = 2000  # SpecForge prepare_hidden_states.py --file-group-size default
LINK_SUFFIX = ".ckpt"

_GROUP_DIR = re.compile(r"^rows_(\d+)-(\d+)$")
_LINK_NAME = re.compile(r"^data_(\d+)\.ckpt$")


def group_dir(i: int, group_size: int) -> str:
    g = (i // group_size) * group_size
    return f"rows_{g}-{g + group_size}"


def link_relpath(i: int, group_size: int) -> str:
    """`rows_{g}-{g+size}/data_{i}.ckpt`, as SpecForge's own writer names sample i."""
    return f"{group_dir(i, group_size)}/data_{i}{LINK_SUFFIX}"


class Folders:
    """Directories below a root (DEST, an output), each opened once without following a link
    (fsutil.open_dir_nofollow): (root, rel) -> fd, closed together."""

    def __init__(self) -> None:
        self.fds: dict[tuple[str, str], int] = {}

    def get(self, root: str, rel: str, create: bool = False) -> int:
        """The folder's fd: FileNotFoundError when absent (unless `create`), LinkRefused when it
        or a folder on the way is a link."""
        fd = self.fds.get((root, rel))
        if fd is None:
            fd = self.fds[(root, rel)] = open_dir_nofollow(root, rel, create=create)
        return fd

    def close(self) -> None:
        fds, self.fds = list(self.fds.values()), {}
        for fd in fds:
            os.close(fd)


def _lstat(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _link_ok(name: str, dir_fd: int, target: str, mode: str, target_stat: os.stat_result | None) -> bool:
    try:
        if mode == "symlink":
            return os.readlink(name, dir_fd=dir_fd) == target
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return target_stat is not None and (st.st_dev, st.st_ino) == (target_stat.st_dev, target_stat.st_ino)


def _make_link(
    path: str, target: str, mode: str, *, dir_fd: int, source: tuple[int, str] | None = None
) -> None:
    """Create or replace `path` (its name in the folder `dir_fd`) atomically: a link at a temp
    name, then rename over. A hard link is made from `source` (the shard's folder fd, its name)."""
    name = os.path.basename(path)
    tmp = temp_name(name)
    if mode == "symlink":
        os.symlink(target, tmp, dir_fd=dir_fd)
    else:
        assert source is not None
        os.link(source[1], tmp, src_dir_fd=source[0], dst_dir_fd=dir_fd, follow_symlinks=False)
    try:
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def _shard_stat(rec: MappingRecord, sources: Folders) -> tuple[os.stat_result | None, int | None, str]:
    """(the shard's lstat, its folder's fd, why not) for a record's shard, looked at relative to
    its folder in the output, opened without following a link: (None, None, why) when it is gone
    or is no longer a file of that folder (a link put in its place or on the way since it was
    verified: not followed)."""
    folder, name = rec.shard.rpartition("/")[::2]
    try:
        fd = sources.get(rec.output, folder)
        st = _lstat(name, fd)
    except FileNotFoundError:
        return None, None, "shard vanished during the export"
    except LinkRefused as e:
        return None, None, f"{e.path} is {e.found} since the shard was verified (not followed)"
    except ValueError:  # a path with `..` or empty parts: never one the verified index gives
        return None, None, f"shard path {rec.shard!r} is not below the output (not followed)"
    if st is None:
        return None, None, "shard vanished during the export"
    if not stat.S_ISREG(st.st_mode):
        return None, None, "shard is no longer a regular file (not followed)"
    return st, fd, ""


def check_groups(dest: str, want: dict[int, MappingRecord | None], group_size: int) -> None:
    """Before anything is committed: every group folder a number needs must not be a link
    (ExportError naming it; it is not followed, and DEST is left as it was)."""
    for g in sorted({group_dir(i, group_size) for i, rec in want.items() if rec is not None}):
        path = os.path.join(dest, g)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise ExportError(
                str(LinkRefused(path, "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"))
            )


def probe_hardlink(rec: MappingRecord, dest: str) -> None:
    """Fail early (nothing done) when DEST cannot hold hard links to OUTPUT's shards: a link to
    `rec`'s shard (from its folder, opened without following a link) made in DEST and removed."""
    target, tmp = rec.target, temp_name("probe")
    folder, name = rec.shard.rpartition("/")[::2]
    try:
        src = open_dir_nofollow(rec.output, folder)
    except (OSError, ValueError) as e:
        raise ExportError(f"cannot hard-link {target} into {dest}: {e}") from None
    try:
        dfd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except BaseException:
        os.close(src)
        raise
    try:
        os.link(name, tmp, src_dir_fd=src, dst_dir_fd=dfd, follow_symlinks=False)
    except OSError as e:
        if e.errno == errno.EXDEV:
            raise ExportError(
                f"cannot hard-link across filesystems: shard {target} and view {dest} are on "
                "different filesystems (EXDEV); use --link symlink or a DEST on the same filesystem"
            ) from None
        raise ExportError(f"cannot hard-link {target} into {dest}: {e.strerror or e}") from None
    else:
        os.unlink(tmp, dir_fd=dfd)
    finally:
        os.close(src)
        os.close(dfd)


def apply_links(
    dest: str,
    records: dict[int, MappingRecord],
    want: dict[int, MappingRecord | None],
    reasons: dict[int, str],
    first_new: int,
    report: ExportReport,
) -> None:
    """Make DEST's links what `want` says (number -> record to link, or None to unlink).

    Every number in `want` must already be in `records` (and so in the fsynced mapping). A shard
    gone since it was verified is unlinked and its number set to None in `want`. Then the sweep
    removes what no live number owns, the touched directories are fsynced, and the report gets
    unlinked, relinked, leftovers_removed, unknown and linked. Every folder is opened without
    following a link (LinkRefused for a group folder a number needs that is one).
    """
    link, group_size = report.link, report.group_size
    folders, sources = Folders(), Folders()
    touched: set[str] = set()  # group folder names; "" for DEST itself
    try:
        for i, rec in sorted(want.items()):
            rel = link_relpath(i, group_size)
            group, name = rel.split("/")
            path = os.path.join(dest, rel)
            if rec is None:
                if _unlink_link(folders, dest, group, name):
                    touched.add(group)
                report.unlinked.append({"i": i, "id": records[i].sample_id, "reason": reasons[i]})
                continue
            # a concurrent `hsx verify --quarantine` may have moved it since we verified
            target_stat, source_fd, why = _shard_stat(rec, sources)
            if target_stat is None:
                if _unlink_link(folders, dest, group, name):
                    touched.add(group)
                report.unlinked.append({"i": i, "id": rec.sample_id, "reason": why})
                want[i] = None
                continue
            made = (dest, group) not in folders.fds and _lstat(group, folders.get(dest, "")) is None
            gfd = folders.get(dest, group, create=True)
            if made:
                touched.add("")
            if not _link_ok(name, gfd, rec.target, link, target_stat):
                source = (source_fd, os.path.basename(rec.shard)) if source_fd is not None else None
                _make_link(path, rec.target, link, dir_fd=gfd, source=source)
                touched.add(group)
                if i < first_new:
                    report.relinked += 1
        _sweep(dest, folders, records, want, group_size, report, touched)
        for g in sorted(touched):
            os.fsync(folders.get(dest, g))
        report.linked = sum(1 for i in records if _has_link(folders, dest, link_relpath(i, group_size)))
    finally:
        folders.close()
        sources.close()


def _unlink_link(folders: Folders, dest: str, group: str, name: str) -> bool:
    """Remove DEST/group/name if it is there (relative to the group's fd): whether it was."""
    try:
        gfd = folders.get(dest, group)
    except (FileNotFoundError, LinkRefused):  # no folder, or not ours: no link of ours in it
        return False
    try:
        os.unlink(name, dir_fd=gfd)
    except FileNotFoundError:
        return False
    return True


def _has_link(folders: Folders, dest: str, rel: str) -> bool:
    group, name = rel.split("/")
    try:
        return _lstat(name, folders.get(dest, group)) is not None
    except (FileNotFoundError, LinkRefused):
        return False


def _sweep(
    dest: str,
    folders: Folders,
    records: dict[int, MappingRecord],
    want: dict[int, MappingRecord | None],
    group_size: int,
    report: ExportReport,
    touched: set[str],
) -> None:
    """Remove what a crash or an unlink left behind: our temps, links without a live number.
    A group folder that is a link is not ours: reported as unknown, never looked into."""
    dfd = folders.get(dest, "")
    for name in sorted(os.listdir(dfd)):
        if name in (META_NAME, MAPPING_NAME, LOCK_NAME):
            continue
        if is_temp_name(name):
            os.unlink(name, dir_fd=dfd)
            report.leftovers_removed.append(name)
            touched.add("")
            continue
        if not _GROUP_DIR.match(name):
            report.unknown.append(name)
            continue
        try:
            gfd = folders.get(dest, name)
        except (LinkRefused, FileNotFoundError):
            report.unknown.append(name)
            continue
        for entry in sorted(os.listdir(gfd)):
            m = _LINK_NAME.match(entry)
            if is_temp_name(entry):
                stale = True
            elif m:
                i = int(m.group(1))
                stale = (
                    i not in records or want.get(i, records[i]) is None or group_dir(i, group_size) != name
                )
            else:
                report.unknown.append(f"{name}/{entry}")
                continue
            st = _lstat(entry, gfd)
            if stale and st is not None and not stat.S_ISDIR(st.st_mode):
                os.unlink(entry, dir_fd=gfd)
                report.leftovers_removed.append(f"{name}/{entry}")
                touched.add(name)
