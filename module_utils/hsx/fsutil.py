"""Crash-safe file operations: atomic replace, directory fsync, the writer temps a crash leaves, and
opening what lies below an output directory without following a link.

atomic_write_bytes publishes a file by renaming a temp of its own from the same directory over
it, so a reader sees the old file or the new one, never a part. Writer temps are named by
layout.temp_name; those a crash leaves behind are what find_orphan_temps lists.

No link below the root is followed. The job runs as root, and an output directory (or the view
export-view writes, or /data) may be writable by other users or left odd by a crash: a symlink
planted at `OUTPUT/shards`, `OUTPUT/index.jsonl` or a temp's name would have root write, move or
delete through it, anywhere. So everything written below a root goes through a directory fd
opened component by component with O_NOFOLLOW (open_dir_nofollow) and a file opened with
O_NOFOLLOW (open_nofollow), renames and unlinks relative to that directory fd, and temps that
are created O_EXCL under names nobody can guess. A link where one of our entries should be is
refused (LinkRefused, naming it), never followed and never removed: we do not make links there,
so someone else did. The root itself (OUTPUT, DEST) may be a link - to another disk, say: it is
the operator's path, resolved where it is opened; its parent must not be writable by others.

read_regular is the one bounded reader of a file outside an output directory that someone else
may have put there (a model's config.json, a source file to patch): regular files only, never
blocking on a FIFO, a byte limit, links refused unless the caller follows them.
"""

from __future__ import annotations

import errno
import os
import stat

from .layout import SHARDS_DIR, is_temp_name, temp_name

O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL  # what open(path, "xb") asks for


class LinkRefused(OSError):
    """A symlink (or something else that is not ours) where an entry of ours should be below an
    output root: refused, not followed. str() is the whole message, naming the path."""

    def __init__(self, path: str, found: str = "a symlink", action: str = "write"):
        super().__init__(
            errno.ELOOP,
            f"{path} is {found}: refusing to {action} through it (nothing below an output directory "
            "is followed: hsx runs as root there and never makes links of its own there); "
            "remove it, or put the real directory or file in its place, and run again",
        )
        self.path = path
        self.found = found

    def __str__(self) -> str:
        return str(self.strerror)


def _what_is(name: str, dir_fd: int | None) -> str | None:
    """'a symlink', 'not a directory' ... for the entry `name` (None: no entry, or a directory)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "a symlink"
    return None if stat.S_ISDIR(st.st_mode) else "not a directory"


def open_subdir(dir_fd: int, name: str, path: str, *, create: bool = False) -> int:
    """The directory `name` of the directory `dir_fd`, opened without following a link (`path`
    names it in messages). With `create` it is made first if absent (0o777 less the umask, as
    os.makedirs does) and the new entry fsynced in `dir_fd`. LinkRefused for a link or a
    non-directory there."""
    if create:
        try:
            os.mkdir(name, dir_fd=dir_fd)
            os.fsync(dir_fd)
        except FileExistsError:
            pass
    try:
        return os.open(name, DIR_FLAGS | O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            found = _what_is(name, dir_fd)
            if found is not None:
                raise LinkRefused(path, found) from None
        raise


def open_dir_nofollow(root: str, rel: str = "", *, create: bool = False) -> int:
    """The directory `root/rel` as an fd: `root` opened as given (a link there is followed: it is
    the operator's path), then each component of `rel` ('a/b') without following a link
    (open_subdir, created when `create`). The caller closes the fd."""
    parts = rel.split("/") if rel else []
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{rel!r}: not a path below {root}")
    fd = os.open(root, DIR_FLAGS)
    path = root
    try:
        for part in parts:
            path = os.path.join(path, part)
            sub = open_subdir(fd, part, path, create=create)
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_nofollow(
    name: str, flags: int, mode: int = 0o666, *, dir_fd: int | None = None, path: str = ""
) -> int:
    """os.open of a file that must be a regular file of ours: never through a symlink (a link at
    `name` is LinkRefused), never blocking on a FIFO put there, close-on-exec. `name` is relative
    to `dir_fd` when given; `path` names it in messages (default `name`)."""
    where = path or name
    new = flags & _NEW_FILE == _NEW_FILE  # created here, or nothing: a file of ours
    try:
        fd = os.open(
            name, flags | O_NOFOLLOW | O_CLOEXEC | (0 if new else os.O_NONBLOCK), mode, dir_fd=dir_fd
        )
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LinkRefused(where) from None
        if e.errno == errno.ENXIO:  # a FIFO with no reader, opened for writing
            raise LinkRefused(where, "not a regular file") from None
        raise
    if not new:  # an existing entry may have been opened: it must be a regular file
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
            if regular:  # O_NONBLOCK was for a FIFO's open only
                os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        if not regular:
            os.close(fd)
            raise LinkRefused(where, "not a regular file")
    return fd


def read_nofollow(path: str, limit: int = -1) -> bytes:
    """The bytes of `path` (at most `limit` when not -1), a file we did not necessarily write
    (run.json, index.jsonl, status.json): never through a symlink, never blocking on a FIFO,
    only a regular file. LinkRefused (an OSError naming `path`, "refusing to read through it")
    for anything else there; FileNotFoundError when there is nothing."""
    try:
        fd = open_nofollow(path, os.O_RDONLY)
    except LinkRefused as e:
        raise LinkRefused(e.path, e.found, "read") from None
    with open(fd, "rb") as f:
        return f.read(limit)


def read_regular(path: str, limit: int | None, *, follow_links: bool = False) -> bytes:
    """The bytes of the regular file `path`, one someone else may have put there (a model's
    config.json, a source file to patch): never blocking on a FIFO or a device put at its name,
    refused unless a regular file, refused when over `limit` bytes (None: no cap). A symlink at
    `path` is refused unless `follow_links` (a hub snapshot's files are links, so are some
    installs' sources); its directories are resolved as given either way.

    Errors name `path` (as their filename; the caller words its own message from `strerror`):
    OSError when it cannot be opened or read (FileNotFoundError ...), is a symlink and
    `follow_links` is off (ELOOP, "a symlink, not followed"), or is not a regular file (EINVAL,
    "not a regular file"); ValueError "PATH: over LIMIT bytes" when larger than `limit`."""
    flags = os.O_RDONLY | os.O_NONBLOCK | O_CLOEXEC | (0 if follow_links else O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_links and os.path.islink(path):
            raise OSError(errno.ELOOP, "a symlink, not followed", path) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        with open(fd, "rb", closefd=False) as f:
            data = f.read(-1 if limit is None else limit + 1)
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, path) from None
        raise
    finally:
        os.close(fd)
    if limit is not None and len(data) > limit:
        raise ValueError(f"{path}: over {limit} bytes")
    return data


def nofollow_opener(path: str, flags: int) -> int:
    """open_nofollow as the `opener` of builtin open(): `open(p, "a", opener=nofollow_opener)`."""
    return open_nofollow(path, flags)


def atomic_write_bytes(
    path: str, data: bytes, *, dir_fd: int | None = None, durable: bool = True, mode: int | None = None
) -> None:
    """Temp in the same directory -> write -> fsync -> rename -> fsync the directory.

    The temp is created O_EXCL|O_NOFOLLOW under a name nobody can guess (layout.temp_name), and
    renamed relative to the directory's fd: the file's own name being a link replaces the link.
    With `dir_fd` (a directory opened by open_dir_nofollow), `path` is a name in it; else the
    directory of `path` is opened as given. `durable=False` skips both fsyncs (a file rewritten
    every few seconds, whose lost update costs nothing). `mode`: the temp is made with it, whatever
    the umask (the file never has another mode under its name); default 0666 less the umask."""
    directory, name = os.path.split(path)
    if dir_fd is not None and directory:
        raise ValueError(f"{path}: with dir_fd, a name in that directory")
    dfd = os.open(directory or ".", DIR_FLAGS) if dir_fd is None else dir_fd
    try:
        tmp = temp_name(name)
        try:
            fd = open_nofollow(tmp, _NEW_FILE, 0o666 if mode is None else mode, dir_fd=dfd,
                               path=os.path.join(directory, tmp))
            with open(fd, "wb") as f:
                if mode is not None:
                    os.fchmod(f.fileno(), mode)
                f.write(data)
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            unlink_quiet(tmp, dir_fd=dfd)
            raise
        if durable:
            os.fsync(dfd)
    finally:
        if dir_fd is None:
            os.close(dfd)


def fsync_dir(directory: str) -> None:
    """Make the directory's entries (a rename, a new or removed file) durable."""
    fd = os.open(directory, DIR_FLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quiet(path: str, *, dir_fd: int | None = None) -> None:
    """Remove a file if it is there; any error is ignored (cleanup after a failure)."""
    try:
        os.unlink(path, dir_fd=dir_fd)
    except OSError:
        pass


# --- orphan temps ---------------------------------------------------------------------------
def find_orphan_temps(output_dir: str) -> list[str]:
    """Writer temp files (relative paths) in the output root and every shard bucket.

    Listed through directories opened without following a link: a `shards/` or bucket that is a
    link is not the output's, and nothing behind it is listed (or, so, removed)."""
    found: list[str] = []
    try:
        root = open_dir_nofollow(output_dir)
    except FileNotFoundError:
        return found
    try:
        with os.scandir(root) as it:
            found += [e.name for e in it if is_temp_name(e.name) and e.is_file(follow_symlinks=False)]
        try:
            shards = open_subdir(root, SHARDS_DIR, os.path.join(output_dir, SHARDS_DIR))
        except (FileNotFoundError, LinkRefused):
            return sorted(found)
    finally:
        os.close(root)
    try:
        with os.scandir(shards) as it:
            entries = list(it)
        for e in entries:
            if is_temp_name(e.name) and e.is_file(follow_symlinks=False):
                found.append(f"{SHARDS_DIR}/{e.name}")
            elif e.is_dir(follow_symlinks=False):
                try:
                    bucket = open_subdir(shards, e.name, os.path.join(output_dir, SHARDS_DIR, e.name))
                except (FileNotFoundError, LinkRefused):  # gone, or swapped for a link since
                    continue
                try:
                    with os.scandir(bucket) as names:
                        found += [
                            f"{SHARDS_DIR}/{e.name}/{b.name}"
                            for b in names
                            if is_temp_name(b.name) and b.is_file(follow_symlinks=False)
                        ]
                finally:
                    os.close(bucket)
    finally:
        os.close(shards)
    return sorted(found)


def remove_temps(output_dir: str, rels: list[str], older_than: float | None = None) -> list[str]:
    """Delete the writer temps `rels` (paths relative to output_dir, as find_orphan_temps gives
    them), each unlinked relative to its folder opened without following a link: LinkRefused
    when a folder on the way is a link, before anything was removed from it. With `older_than`
    (a time), only those last modified at or before it. Returns the ones removed."""
    removed: list[str] = []
    folders: dict[str, int] = {}
    try:
        for rel in rels:
            folder, name = rel.rpartition("/")[::2]
            if not is_temp_name(name):
                raise ValueError(f"{rel}: not a writer temp")
            fd = folders.get(folder)
            if fd is None:
                fd = folders[folder] = open_dir_nofollow(output_dir, folder)
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or (older_than is not None and st.st_mtime > older_than):
                    continue
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                continue
            removed.append(rel)
    finally:
        for fd in folders.values():
            os.close(fd)
    return removed


def remove_orphan_temps(output_dir: str) -> list[str]:
    """Delete the temp files find_orphan_temps lists; returns the ones removed."""
    return remove_temps(output_dir, find_orphan_temps(output_dir))
