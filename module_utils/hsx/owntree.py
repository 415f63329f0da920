"""Give a directory tree to an account without following a link (the own_tree module; roles/hsx's
`own_tree` entry point gives the extraction's output and the dump directory to the hsx account).

A SPEC is `PATH` (the top may be a link: the operator's path, e.g. OUTPUT on another disk; it must be
root's own link to an existing directory - a dangling link, or one another user made, is refused) or
`=PATH` (the top must be a real directory: a link there is refused, e.g. the dump directory).
For each PATH (run as root): creates it if absent (0750, missing parents root's 0755); refuses a top
owned by someone other than root or the account (not ours to take); then walks it by directory
descriptors (iteratively, whatever its depth; links never followed) and, for every directory and
regular file not already the account's (uid and gid), sets that owner and clears the bits of others
(files 0640, directories 0750 from the usual 0644/0755) and setuid/setgid; what is already the
account's keeps the modes the job gave it. Never touched, only counted: links (their targets stay as
they are), files with more than one hard link (one may be a planted link to a file outside, e.g.
/etc/shadow), and anything not a directory or regular file (FIFOs, devices, sockets).
With `check` nothing changes and the counts say what would.

Part of the stdlib-only core: shipped to Ansible hosts as ansible.module_utils.hsx.owntree.
"""

from __future__ import annotations

import os
import stat
import typing as t

OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def fix(fd: int, uid: int, gid: int, check: bool, counts: dict) -> None:
    """Owner and mode of the object behind `fd` (a directory or regular file we opened without following)."""
    st = os.fstat(fd)
    mode = stat.S_IMODE(st.st_mode)
    want = mode & ~0o007 & ~0o6000  # no bits for others, no setuid/setgid
    if stat.S_ISDIR(st.st_mode):
        want = (want | 0o700) & ~0o007
    if st.st_uid == uid and st.st_gid == gid:
        return  # already the account's: its modes are the job's own (e.g. metrics.prom, 0644 on purpose)
    counts["changed"] += 1
    if check:
        return
    if st.st_uid != uid or st.st_gid != gid:
        os.fchown(fd, uid, gid)
    os.fchmod(fd, want)


class OwnTreeError(Exception):
    """A refusal or an error, said for a person (no traceback): what, where, and what to do."""


def refuse(message: str) -> t.NoReturn:
    """Stop with `message` (OwnTreeError)."""
    raise OwnTreeError(message)


def check_top_link(path: str, top_st: os.stat_result, strict: bool) -> None:
    """A link at the top: refused where the path must be real (`=PATH`); else followed only when
    root made it (anyone else's link would point root's chown anywhere, /etc say) and it leads to
    a directory."""
    target = os.readlink(path)
    if strict:
        refuse(
            f"{path} is a symbolic link (to {target}); refusing to use it: "
            "someone may have planted it. Remove it and run again."
        )
    if top_st.st_uid != 0:
        refuse(
            f"{path} is a symbolic link (to {target}) owned by uid {top_st.st_uid}, a link only root may make "
            "here: refusing to follow it (someone may have planted it). Remove it, or make it as root, and run again."
        )
    try:
        st = os.stat(path)
    except FileNotFoundError:
        refuse(
            f"{path} is a symbolic link to {target}, which does not exist: create the directory it points to "
            "(or point the link at the real output directory) and run again."
        )
    if not stat.S_ISDIR(st.st_mode):
        refuse(f"{path} is a symbolic link to {target}, which is not a directory: point it at a directory and run again.")


def own_file(name: str, dirfd: int, uid: int, gid: int, check: bool, counts: dict) -> None:
    """One entry of a directory that is not a directory: a regular file with one link is fixed,
    the rest counted (see this file's docstring)."""
    lst = os.lstat(name, dir_fd=dirfd)
    if stat.S_ISLNK(lst.st_mode):
        counts["skipped_links"] += 1
        return
    if not stat.S_ISREG(lst.st_mode):
        counts["skipped_other"] += 1
        return
    try:
        fd = os.open(name, OPEN_FLAGS, dir_fd=dirfd)
    except OSError:  # gone, or swapped for a link since the lstat: not ours to touch
        counts["skipped_other"] += 1
        return
    try:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode):
            counts["skipped_other"] += 1
        elif fst.st_nlink > 1:
            counts["skipped_hardlinks"] += 1
        else:
            fix(fd, uid, gid, check, counts)
    finally:
        os.close(fd)


def walk(top: int, uid: int, gid: int, check: bool, counts: dict) -> None:
    """Every directory below the open directory `top` (closed here) and its entries, without
    recursion (a tree may be deeper than Python's stack) and without following a link: a
    directory is opened relative to its parent's fd with O_NOFOLLOW, its subdirectories are
    opened before the parent's fd is closed; the fds held are those of the directories opened
    and not yet visited (a chain of any depth holds one)."""
    pending = [top]
    first = True  # `top` is fixed by the caller (an fd number is reused once closed: no `is` test)
    try:
        while pending:
            dirfd = pending.pop()
            try:
                if not first:
                    fix(dirfd, uid, gid, check, counts)
                first = False
                for name in sorted(os.listdir(dirfd)):
                    try:
                        sub = os.open(name, DIR_FLAGS, dir_fd=dirfd)
                    except OSError:  # not a directory, a link, or gone: a file's own checks decide
                        own_file(name, dirfd, uid, gid, check, counts)
                        continue
                    pending.append(sub)
            except FileNotFoundError:
                continue  # a directory removed while we walk: nothing left to own there
            finally:
                os.close(dirfd)
    finally:
        for fd in pending:
            os.close(fd)


def own(spec: str, uid: int, gid: int, check: bool) -> dict:
    """One SPEC: the counts {created, changed, skipped_links, skipped_hardlinks, skipped_other}."""
    strict = spec.startswith("=")
    path = spec[1:] if strict else spec
    counts = {"created": False, "changed": 0, "skipped_links": 0, "skipped_hardlinks": 0, "skipped_other": 0}
    if not os.path.isabs(path):
        refuse(f"{path} is not an absolute path")
    try:
        top_st = os.lstat(path)
    except FileNotFoundError:
        top_st = None
    if top_st is not None and stat.S_ISLNK(top_st.st_mode):
        check_top_link(path, top_st, strict)
    if top_st is None:
        counts["created"] = True
        if check:
            return counts
        parent = os.path.dirname(path)
        os.makedirs(parent, mode=0o755, exist_ok=True)
        os.mkdir(path, 0o750)
    top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (os.O_NOFOLLOW if strict else 0))
    try:
        st = os.fstat(top)
        if st.st_uid not in (0, uid):
            refuse(
                f"{path} belongs to uid {st.st_uid}, neither root nor the hsx account: "
                "not ours to take over. Move it away (or choose another path) and run again."
            )
        fix(top, uid, gid, check, counts)
    except BaseException:
        os.close(top)
        raise
    walk(top, uid, gid, check, counts)
    return counts


def own_trees(specs: t.Sequence[str], uid: int, gid: int, check: bool) -> dict[str, dict]:
    """{PATH: counts} for each SPEC, in order; OwnTreeError for the first refusal or error (the
    trees before it were done, nothing further was changed)."""
    result = {}
    for spec in specs:
        try:
            result[spec.lstrip("=")] = own(spec, uid, gid, check)
        except OSError as e:  # a disk error, too many open files, a path that changed under us
            refuse(f"{spec.lstrip('=')}: {e.filename or ''}: {e.strerror or e}; nothing further was changed there")
    return result
