"""What /proc says about a process: alive (and the same process), owner, command line, systemd unit,
whether it holds a device open. Read by the gpu_processes module before it signals anything.

The command line is redacted as it is read (hsx.redact: `--api-key K` -> `--api-key <redacted>`), so
no copy of a secret given on a command line leaves this module, in a result, a message or a log.

A pid is only a number: it names a process of this PID namespace, and may have been reused since
it was listed. So `info()` records the start time, and `alive()` checks it again before a signal.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass

from .redact import redact_argv


@dataclass
class ProcInfo:
    """What /proc says about one pid."""

    visible: bool
    start_time: str | None = None
    user: str | None = None
    cmdline: str | None = None  # arguments joined by spaces, redacted
    unit: str | None = None
    holds_device: bool | None = None


class ProcTable:
    """Reads processes from `root` (/proc); `device_prefix` is what an open device's path starts with."""

    def __init__(self, root: str = "/proc", device_prefix: str = "/dev/"):
        self.root = root
        self.device_prefix = device_prefix

    def _read(self, pid: int, name: str) -> str:
        with open(f"{self.root}/{pid}/{name}", encoding="utf-8", errors="replace") as f:
            return f.read()

    def _stat(self, pid: int) -> tuple[str, str] | None:
        """(state, start time) of a live pid, None if gone."""
        try:
            stat = self._read(pid, "stat")
        except (FileNotFoundError, ProcessLookupError):
            return None
        fields = stat[stat.rindex(")") + 2 :].split()  # comm may contain spaces and parentheses
        return fields[0], fields[19]

    def alive(self, pid: int, start_time: str | None) -> bool:
        """The same process (pid and start time) still exists and is not a zombie."""
        st = self._stat(pid)
        return st is not None and st[0] not in ("Z", "X") and (start_time is None or st[1] == start_time)

    def info(self, pid: int) -> ProcInfo:
        st = self._stat(pid) if pid > 0 else None
        if st is None or st[0] in ("Z", "X"):
            return ProcInfo(visible=False)
        try:
            uid = os.stat(f"{self.root}/{pid}").st_uid
            try:
                user = pwd.getpwuid(uid).pw_name
            except KeyError:
                user = str(uid)
            argv = self._read(pid, "cmdline").split("\0")
            cmdline = " ".join(redact_argv(a for a in argv if a)) or f"[{self._read(pid, 'comm').strip()}]"
            unit = self._unit(self._read(pid, "cgroup"))
        except (FileNotFoundError, ProcessLookupError):
            return ProcInfo(visible=False)
        return ProcInfo(True, st[1], user, cmdline, unit, self._holds_device(pid))

    @staticmethod
    def _unit(cgroup: str) -> str | None:
        """The systemd unit of a process: the last *.service/*.scope element of its cgroup path."""
        for line in cgroup.splitlines():
            for part in reversed(line.split(":", 2)[-1].split("/")):
                if part.endswith((".service", ".scope")):
                    return part
        return None

    def _holds_device(self, pid: int) -> bool | None:
        """Has a file under device_prefix open; None when its descriptors cannot be read (not root)."""
        fd_dir = f"{self.root}/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except PermissionError:
            return None
        except (FileNotFoundError, ProcessLookupError):
            return False
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}").startswith(self.device_prefix):
                    return True
            except OSError:
                continue
        return False
