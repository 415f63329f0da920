"""The links of an export view: their names, how one is made safely, and bringing DEST in line.

Names are SpecForge's own (`rows_{g}-{g + group_size}/data_{i}.ckpt`, see extraction.export_view).
A link is made at a temp name and renamed into place, so a reader never sees a half-made one and
a crash leaves at worst a temp that the next run's sweep removes.

Symlinks are absolute: DEST usually lives on the training side (another directory tree, often
another filesystem), so a relative link would break whenever either tree is moved or mounted
elsewhere; an absolute one breaks only when OUTPUT moves, and a re-run with the new OUTPUT path
re-points every link without renumbering.
"""

from __future__ import annotations

import errno
import os
import re
from typing import TYPE_CHECKING

from extraction.export_mapping import MAPPING_NAME, META_NAME, ExportError, MappingRecord
from hsx.fsutil import fsync_dir
from hsx.layout import is_temp_name, temp_name

if TYPE_CHECKING:
    from extraction.export_view import ExportReport

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


def _link_ok(path: str, target: str, mode: str, target_stat: os.stat_result | None) -> bool:
    try:
        if mode == "symlink":
            return os.readlink(path) == target
        st = os.lstat(path)
    except OSError:
        return False
    return target_stat is not None and (st.st_dev, st.st_ino) == (target_stat.st_dev, target_stat.st_ino)


def _make_link(path: str, target: str, mode: str) -> None:
    """Create or replace `path` atomically: a link at a temp name, then rename over."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, temp_name(name))
    if mode == "symlink":
        os.symlink(target, tmp)
    else:
        os.link(target, tmp, follow_symlinks=False)
    try:
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def probe_hardlink(target: str, dest: str) -> None:
    """Fail early (nothing done) when DEST cannot hold hard links to OUTPUT's shards."""
    tmp = os.path.join(dest, temp_name("probe"))
    try:
        os.link(target, tmp, follow_symlinks=False)
    except OSError as e:
        if e.errno == errno.EXDEV:
            raise ExportError(
                f"cannot hard-link across filesystems: shard {target} and view {dest} are on "
                "different filesystems (EXDEV); use --link symlink or a DEST on the same filesystem"
            ) from None
        raise ExportError(f"cannot hard-link {target} into {dest}: {e.strerror or e}") from None
    os.unlink(tmp)


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
    unlinked, relinked, leftovers_removed, unknown and linked.
    """
    link, group_size = report.link, report.group_size
    touched: set[str] = set()
    made_groups: set[str] = set()
    for i, rec in sorted(want.items()):
        rel = link_relpath(i, group_size)
        path = os.path.join(dest, rel)
        if rec is None:
            if os.path.lexists(path):
                os.unlink(path)
                touched.add(os.path.dirname(path))
            report.unlinked.append({"i": i, "id": records[i].sample_id, "reason": reasons[i]})
            continue
        try:  # a concurrent `hsx verify --quarantine` may have moved it since we verified
            target_stat = os.stat(rec.target)
        except FileNotFoundError:
            target_stat = None
        if target_stat is None:
            if os.path.lexists(path):
                os.unlink(path)
                touched.add(os.path.dirname(path))
            report.unlinked.append(
                {"i": i, "id": rec.sample_id, "reason": "shard vanished during the export"}
            )
            want[i] = None
            continue
        if not _link_ok(path, rec.target, link, target_stat):
            gdir = os.path.dirname(path)
            if gdir not in made_groups and not os.path.isdir(gdir):
                os.makedirs(gdir, exist_ok=True)
                touched.add(dest)
            made_groups.add(gdir)
            _make_link(path, rec.target, link)
            touched.add(gdir)
            if i < first_new:
                report.relinked += 1
    _sweep(dest, records, want, group_size, report, touched)
    for d in sorted(touched):
        fsync_dir(d)
    report.linked = sum(
        1 for i in records if os.path.lexists(os.path.join(dest, link_relpath(i, group_size)))
    )


def _sweep(
    dest: str,
    records: dict[int, MappingRecord],
    want: dict[int, MappingRecord | None],
    group_size: int,
    report: ExportReport,
    touched: set[str],
) -> None:
    """Remove what a crash or an unlink left behind: our temps, links without a live number."""
    for name in sorted(os.listdir(dest)):
        path = os.path.join(dest, name)
        if name in (META_NAME, MAPPING_NAME, LOCK_NAME):
            continue
        if is_temp_name(name):
            os.unlink(path)
            report.leftovers_removed.append(name)
            touched.add(dest)
            continue
        if not (_GROUP_DIR.match(name) and os.path.isdir(path) and not os.path.islink(path)):
            report.unknown.append(name)
            continue
        for entry in sorted(os.listdir(path)):
            epath = os.path.join(path, entry)
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
            if stale and not os.path.isdir(epath):
                os.unlink(epath)
                report.leftovers_removed.append(f"{name}/{entry}")
                touched.add(path)
