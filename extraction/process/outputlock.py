"""One `hsx extract` per output directory: an flock on OUTPUT/extract.lock for the whole run.

Why: two runners on one output (a manual run beside the job unit's, a unit restarted while its
old process lives on) would each remove the other's temp files as orphans at start-up, publish
the same samples twice and race on status.json. The second is refused instead, saying who holds
the output.

The lock belongs to the open file, not to a pid: the writer process, forked with the file open,
holds it with the runner (it writes to the output too), and the kernel drops it when the last of
them is gone, a kill -9 included, so there is never a stale lock to remove by hand. The file's
text (pid, host, start) is only for the refusal's message.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import socket
import time

from hsx.fsutil import open_nofollow
from hsx.status import pid_alive

LOCK_NAME = "extract.lock"
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
DEAD_HOLDER_WAIT_S = 30.0
_HOLDER = re.compile(r"^pid (\d+) on (\S+) ")


def _recorded_dead(holder: str) -> bool:
    """The lock file names a process of this host that no longer exists."""
    m = _HOLDER.match(holder)
    return bool(m) and pid_alive(int(m.group(1)), m.group(2)) is False


class OutputBusy(RuntimeError):
    """Another runner holds the output directory."""


class OutputLock:
    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self, dead_holder_wait: float = DEAD_HOLDER_WAIT_S) -> str | None:
        """Take the lock without waiting on a live runner: OutputBusy (who holds it) if one has it.
        A holder recorded as dead on this host (a runner just killed -9, its writer process still
        being torn down by the kernel) is waited for, up to `dead_holder_wait` seconds.
        Where the filesystem has no locks (some network and FUSE mounts) the run goes on without
        one: the reason is returned, for the log."""
        if self._fd is not None:
            return None
        # Never through a link (fsutil.LinkRefused): root would create, truncate and write the
        # file it points at.
        fd = open_nofollow(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            deadline = time.monotonic() + dead_holder_wait
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
                    dead = _recorded_dead(holder)
                    if dead and time.monotonic() < deadline:
                        time.sleep(0.05)
                        continue
                    gone = " (exited; a process it forked still has the output open)" if dead else ""
                    raise OutputBusy(
                        f"{self.output_dir} is in use by another hsx extract ({holder or 'holder unknown'}{gone}); "
                        "one run per output directory"
                    ) from None
        except OSError as e:
            os.close(fd)
            if e.errno in _NO_LOCKS:
                return f"no lock on {self.path} ({e.strerror}): nothing stops a second run on this output"
            raise
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        text = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n"
        try:  # for a refusal's message only: a full disk must not cost the lock
            os.ftruncate(fd, 0)
            os.pwrite(fd, text.encode(), 0)
        except OSError:
            pass
        return None

    def release(self) -> None:
        """Close this process's copy of the file: the lock goes once no process has it open (a
        forked child that never writes to the output calls this too; an unlock would drop the
        lock for every process sharing it)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self.release()
