"""Listing an output directory: its bucket folders, its shards, and writer temps left behind."""

from __future__ import annotations

import os

from ..layout import SHARD_SUFFIX, SHARDS_DIR, TEMP_PREFIX, is_temp_name


def scan_shards(output_dir: str) -> list[str]:
    """Relative paths of every `.pt` entry in shards/<bucket>/ (regular files or not)."""
    return list_shards(output_dir, orphans=None)


def list_buckets(output_dir: str, orphans: list[str] | None) -> list[str]:
    """The bucket folders of shards/ (sorted); temps in the output root and shards/ go to `orphans`."""
    if orphans is not None:
        with os.scandir(output_dir) as it:
            orphans.extend(e.name for e in it if is_temp_name(e.name) and e.is_file(follow_symlinks=False))
    try:
        with os.scandir(os.path.join(output_dir, SHARDS_DIR)) as it:
            entries = list(it)
    except FileNotFoundError:
        return []
    if orphans is not None:
        orphans.extend(
            f"{SHARDS_DIR}/{e.name}"
            for e in entries
            if is_temp_name(e.name) and e.is_file(follow_symlinks=False)
        )
    return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))


def list_shards(output_dir: str, orphans: list[str] | None) -> list[str]:
    """scan_shards, also collecting fsutil.find_orphan_temps' list into `orphans` in the same pass."""
    found: list[str] = []
    buckets = list_buckets(output_dir, orphans)
    root = os.path.join(output_dir, SHARDS_DIR)
    suffix, temp = SHARD_SUFFIX, TEMP_PREFIX
    for b in buckets:
        prefix = f"{SHARDS_DIR}/{b}/"
        with os.scandir(os.path.join(root, b)) as it:
            for e in it:
                name = e.name
                if name.endswith(suffix) and not name.startswith(temp):
                    found.append(prefix + name)
                elif orphans is not None and is_temp_name(name) and e.is_file(follow_symlinks=False):
                    orphans.append(prefix + name)
    found.sort()
    if orphans is not None:
        orphans.sort()
    return found
