"""What a host's filesystems and memory say, read the way the storage checks need it: which mount
(and filesystem type) holds a path, how much room it has, how much RAM is available, and whether a
directory takes a write that reads back.

Part of the stdlib-only core: shipped to Ansible hosts as ansible.module_utils.hsx.hostfs.
"""

from __future__ import annotations

import os
import tempfile

PROBE_PREFIX = ".hsx-write-probe."


def existing_ancestor(path: str) -> str:
    """`path` itself if it is a directory, else its nearest ancestor that is (a directory not made yet
    is measured where it would be made)."""
    probe = os.path.abspath(path)
    while not os.path.isdir(probe):
        probe = os.path.dirname(probe)
    return probe


def mount_of(path: str, mounts: str = "/proc/mounts") -> tuple[str, str]:
    """(mount point, filesystem type) of the longest mount in `mounts` holding `path` (an absolute,
    existing path); ("", "") when none does. Spaces in mount points (\\040) are decoded."""
    best, fstype = "", ""
    with open(mounts, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 3:
                continue
            mnt, typ = fields[1].replace("\\040", " "), fields[2]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fstype = mnt, typ
    return best, fstype


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still write on the filesystem of `path` (f_bavail)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def mem_available(meminfo: str = "/proc/meminfo") -> int:
    """The kernel's MemAvailable in bytes; 0 when it does not say."""
    with open(meminfo, encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def write_probe(directory: str, size: int = 4096) -> str | None:
    """Write `size` random bytes to a new file in `directory`, fsync, read them back through the same
    descriptor, remove that file; None when they read back, else what failed (naming the file).

    The file is new and ours alone: a name nobody can guess, created O_EXCL|O_NOFOLLOW (mkstemp).
    Root runs this in a mount's root, which other users may be able to write: a predictable name
    could be planted as a link, and root would overwrite its target. Only that file is removed."""
    data = os.urandom(size)
    path = os.path.join(directory, PROBE_PREFIX + "*")
    try:
        fd, path = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=directory)
    except OSError as exc:
        return f"cannot write {path}: {exc.strerror or exc}"
    try:
        with os.fdopen(fd, "r+b") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            ok = os.pread(f.fileno(), size + 1, 0) == data
    except OSError as exc:
        return f"cannot write {path}: {exc.strerror or exc}"
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return None if ok else f"read back differs from what was written to {path}"
