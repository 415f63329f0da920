"""Crash-safe file operations: atomic replace, directory fsync, and the writer temps a crash leaves.

atomic_write_bytes publishes a file by renaming a temp of its own from the same directory over
it, so a reader sees the old file or the new one, never a part. Writer temps are named by
layout.temp_name; those a crash leaves behind are what find_orphan_temps lists.
"""

from __future__ import annotations

import os

from .layout import SHARDS_DIR, is_temp_name, temp_name


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Temp in the same directory -> write -> fsync -> rename -> fsync the directory."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, temp_name(name))
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        unlink_quiet(tmp)
        raise
    fsync_dir(directory or ".")


def fsync_dir(directory: str) -> None:
    """Make the directory's entries (a rename, a new or removed file) durable."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quiet(path: str) -> None:
    """Remove a file if it is there; any error is ignored (cleanup after a failure)."""
    try:
        os.unlink(path)
    except OSError:
        pass


# --- orphan temps ---------------------------------------------------------------------------
def find_orphan_temps(output_dir: str) -> list[str]:
    """Writer temp files (relative paths) in the output root and every shard bucket."""
    found = []
    for rel in ("", SHARDS_DIR):
        try:
            with os.scandir(os.path.join(output_dir, rel) if rel else output_dir) as it:
                entries = list(it)
        except FileNotFoundError:
            continue
        for e in entries:
            if is_temp_name(e.name) and e.is_file(follow_symlinks=False):
                found.append(f"{rel}/{e.name}" if rel else e.name)
            elif rel == SHARDS_DIR and e.is_dir(follow_symlinks=False):
                with os.scandir(e.path) as bucket:
                    for b in bucket:
                        if is_temp_name(b.name) and b.is_file(follow_symlinks=False):
                            found.append(f"{SHARDS_DIR}/{e.name}/{b.name}")
    return sorted(found)


def remove_orphan_temps(output_dir: str) -> list[str]:
    """Delete the temp files find_orphan_temps lists; returns the ones removed."""
    removed = []
    for rel in find_orphan_temps(output_dir):
        try:
            os.unlink(os.path.join(output_dir, rel))
        except FileNotFoundError:
            continue
        removed.append(rel)
    return removed
