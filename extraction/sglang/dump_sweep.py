"""A request's files in the dump directory: finding them, removing them, and what a crash leaves.

Names are the hook's (hsx_dump_format: `<rid_stem>.<offset:09d>.pt` for a piece,
`<...>.failed` for a piece it could not write, `.<name>.<server pid>.tmp` while it writes).

Contract:
- `piece_paths(directory, rid)`, `failed_paths(directory, rid)`: that request's pieces and failure
  markers, sorted; names that only look alike (another rid's, another pattern) are not listed.
- `remove_request(directory, rid)`: its pieces and markers deleted (after it was read or given
  up); how many. An entry that cannot be removed is left: the read of that request names it.
- `client_lock(directory)`: the directory's client lock (flock on the directory itself; released
  when the process dies, kill -9 included): its fd, or None when another live client holds it.
- `stale_names(directory, own_prefix, strays)`: for the lock's holder, the files no live request
  will read (a killed client's dumps and markers, a dead server's temps), never another user's;
  what only looks like one of them is a stray, reported, never removed.
"""

from __future__ import annotations

import glob
import os
import re

from extraction.sglang import hsx_dump_format as fmt
from extraction.sglang.hsx_dump_format import FAILED_SUFFIX, rid_stem


def piece_paths(directory: str, rid: str) -> list[str]:
    """The pieces of this request in `directory`, sorted (by offset: the names are padded)."""
    stem = rid_stem(rid)
    names = re.compile(re.escape(stem) + r"\.\d{9}\.pt")
    found = glob.glob(os.path.join(glob.escape(directory), glob.escape(stem) + ".*.pt"))
    return sorted(p for p in found if names.fullmatch(os.path.basename(p)))


def failed_paths(directory: str, rid: str) -> list[str]:
    """The hook's markers for pieces of this request it could not write."""
    stem = rid_stem(rid)
    names = re.compile(re.escape(stem) + r"\.\d{9}" + re.escape(FAILED_SUFFIX))
    found = glob.glob(os.path.join(glob.escape(directory), glob.escape(stem) + ".*" + FAILED_SUFFIX))
    return sorted(p for p in found if names.fullmatch(os.path.basename(p)))


def remove_request(directory: str, rid: str) -> int:
    """Delete a request's pieces and failure markers (after it was read or abandoned); returns how
    many. An entry that cannot be removed (a directory named like a piece) is left: the read of
    that request names it."""
    n = 0
    for path in piece_paths(directory, rid) + failed_paths(directory, rid):
        try:
            os.unlink(path)
            n += 1
        except OSError:
            pass
    return n


RID_PREFIX = fmt.RID_PREFIX  # every rid our client sends starts with it (the hook dumps no other)
_TEMP = re.compile(r"\.(.+)\.(\d+)\.tmp")  # the hook's temp: .<dump or marker name>.<server pid>.tmp
_PID_MAX = 1 << 22  # Linux's PID_MAX_LIMIT: a larger number is no process id


def client_lock(directory: str) -> int | None:
    """Take the dump directory's client lock (flock on the directory itself: no file; released
    when the process dies, kill -9 included): its fd, or None when another live client holds it.
    Only the holder may remove files of other clients' requests (stale_names)."""
    import fcntl

    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists
        return True
    return True


def stale_names(directory: str, own_prefix: str, strays: list[str] | None = None) -> list[str]:
    """Files in `directory` that no live request will read, for the one client holding the lock:
    - dumps and `.failed` markers of requests our client sent (rid starting with RID_PREFIX) but
      not this client instance (`own_prefix`): a client killed before reading them (its late
      pieces land after it died, and are found by the next call);
    - the hook's temps (`.<name>.<pid>.tmp`) of one of our requests whose server process is gone
      (a server killed mid-write). A live server's temps are left alone: it renames them.
    Files of other users of the server (rids without RID_PREFIX) are never touched. An entry
    named like one of these that is not a regular file (a directory, a link, a FIFO) or a temp
    whose pid is no process id is a stray: left alone, and appended to `strays` as
    "name (why)" when given (the caller says so once; it never stops the sweep)."""
    found = []
    try:
        with os.scandir(directory) as it:
            entries = list(it)
    except FileNotFoundError:
        return []
    for entry in entries:
        name, why = entry.name, None
        temp = _TEMP.fullmatch(name)
        if temp is not None:
            if not temp.group(1).startswith(RID_PREFIX):
                continue
            pid = int(temp.group(2))
            if not 0 < pid <= _PID_MAX:
                why = f"pid {temp.group(2)} is no process id"
            elif _alive(pid):
                continue
        elif not (name.startswith(RID_PREFIX) and not name.startswith(own_prefix)):
            continue
        elif not name.endswith((".pt", FAILED_SUFFIX)):
            continue
        try:
            if why is None and not entry.is_file(follow_symlinks=False):
                why = "not a regular file"
        except OSError as exc:
            why = str(exc)
        if why is None:
            found.append(name)
        elif strays is not None:
            strays.append(f"{name} ({why})")
    return sorted(found)
