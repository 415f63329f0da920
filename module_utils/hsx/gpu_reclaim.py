# Copyright: (c) 2026, hsx maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Freeing GPUs: which GPU processes may be ended, the signals that end them, the wait for memory.

Contract:

- `GpuReclaimer(backend, ...)` reads the GPUs through `backend` (a `GpuBackend`: an
  hsx.nvml.PynvmlBackend, or a fake with the same `gpus()`), and what /proc says about each pid
  through `procs` (hsx.procfs.ProcTable; by default one that counts paths under DEVICE_PREFIX,
  looked up when the reclaimer is made, as NVIDIA devices).
- `run("present")` lists and touches nothing. `run("absent")` decides each process (`decide`: never
  one that is not visible here, runs in a protected unit, or does not hold an NVIDIA device open;
  then the allowlist `patterns`, or `force`), sends SIGTERM, SIGKILL after `grace_seconds` to those
  still alive (the same process: its start time is checked before each signal), and with `wait`
  polls the backend until every GPU's used memory is below `memory_threshold_mib`. With
  `check_mode` it signals nothing and reports what it would end.
- It returns the module's result (every RETURN key of the gpu_processes module) or raises
  ReclaimError, whose `result` holds that result with a message naming what still holds the GPUs.
  A PermissionError from a signal is left to the caller.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from .nvml import MIB, Gpu, devices, gpu_result
from .procfs import ProcInfo, ProcTable

# What an open NVIDIA device file's path starts with (/dev/nvidia0, /dev/nvidiactl, /dev/nvidia-uvm).
DEVICE_PREFIX = "/dev/nvidia"


class ReclaimError(Exception):
    """The GPUs could not be freed; `result` holds everything known at that point."""

    def __init__(self, msg: str, result: dict):
        super().__init__(msg)
        self.result = result


class GpuBackend(Protocol):
    """What GpuReclaimer needs of a backend (hsx.nvml.PynvmlBackend, or a fake)."""

    def gpus(self) -> list[Gpu]: ...


@dataclass
class Target:
    """A GPU process and what is decided about it."""

    pid: int
    info: ProcInfo
    gpus: list[int]
    used_bytes: int | None
    action: str = "none"
    reason: str = ""
    signal: str | None = None

    def as_dict(self) -> dict:
        info = self.info
        return {"pid": self.pid, "visible": info.visible, "user": info.user, "cmdline": info.cmdline,
                "unit": info.unit, "gpus": self.gpus,
                "used_memory_mib": None if self.used_bytes is None else self.used_bytes // MIB,
                "holds_device": info.holds_device, "action": self.action, "reason": self.reason,
                "signal": self.signal}


class GpuReclaimer:
    """Finds GPU processes, decides which may be ended, ends them (TERM, then KILL) and waits for memory."""

    def __init__(self, backend: GpuBackend, patterns: Iterable[str] = (), force: bool = False,
                 protect_units: Iterable[str] = (), grace_seconds: float = 15, timeout_seconds: float = 60,
                 memory_threshold_mib: int = 2048, procs: ProcTable | None = None, poll_seconds: float = 0.2):
        self.backend = backend
        self.patterns = [(p, re.compile(p)) for p in patterns]
        self.force = force
        self.protect_units = set(protect_units)
        self.grace = grace_seconds
        self.timeout = timeout_seconds
        self.threshold = memory_threshold_mib * MIB
        self.procs = procs or ProcTable(device_prefix=DEVICE_PREFIX)
        self.poll = poll_seconds

    def targets(self, gpus: list[Gpu]) -> list[Target]:
        """One Target per pid (a process on several GPUs appears once), undecided."""
        by_pid: dict[int, Target] = {}
        for g in gpus:
            for p in g.processes:
                t = by_pid.get(p.pid)
                if t is None:
                    t = by_pid[p.pid] = Target(p.pid, self.procs.info(p.pid), [], None)
                t.gpus.append(g.index)
                if p.used_bytes is not None:
                    t.used_bytes = (t.used_bytes or 0) + p.used_bytes
        return sorted(by_pid.values(), key=lambda t: t.pid)

    def decide(self, t: Target) -> None:
        """Set t.action to 'end' or 'keep', with the reason."""
        t.action = "keep"
        info = t.info
        if not info.visible:
            t.reason = "pid not visible here (another PID namespace or container, or already gone): not touched"
        elif info.unit in self.protect_units:
            t.reason = f"runs in protected unit {info.unit}"
        elif info.holds_device is None:
            t.reason = "cannot read its file descriptors to confirm it holds a GPU (not root?): not touched"
        elif not info.holds_device:
            t.reason = "does not hold an NVIDIA device open (pid reused?): not touched"
        else:
            hit = next((p for p, rx in self.patterns if rx.search(info.cmdline)), None)
            if hit is not None:
                t.action, t.reason = "end", f"matches {hit!r}"
            elif self.force:
                t.action, t.reason = "end", "force"
            else:
                t.reason = "not on the allowlist"

    def _signal(self, t: Target, sig: signal.Signals) -> None:
        if not self.procs.alive(t.pid, t.info.start_time):
            return
        try:
            os.kill(t.pid, sig)
        except ProcessLookupError:
            return
        t.signal = sig.name

    def _poll(self, read: Callable[[], Any], done: Callable[[Any], bool], deadline: float) -> Any:
        """Call read() until done(value) or the deadline passes; the last value."""
        while True:
            value = read()
            if done(value) or time.monotonic() >= deadline:
                return value
            time.sleep(self.poll)

    def _alive(self, targets: list[Target]) -> list[Target]:
        return [t for t in targets if self.procs.alive(t.pid, t.info.start_time)]

    def end(self, targets: list[Target]) -> list[Target]:
        """SIGTERM, SIGKILL after the grace period; returns those still alive after the timeout."""
        for t in targets:
            self._signal(t, signal.SIGTERM)
        survivors = self._poll(lambda: self._alive(targets), lambda alive: not alive, time.monotonic() + self.grace)
        for t in survivors:
            self._signal(t, signal.SIGKILL)
        return self._poll(lambda: self._alive(survivors), lambda alive: not alive, time.monotonic() + self.timeout)

    def _over(self, gpus: list[Gpu]) -> list[Gpu]:
        return [g for g in gpus if g.used_bytes >= self.threshold]

    def wait_for_memory(self, deadline: float) -> list[Gpu]:
        """Poll NVML until every GPU is below the threshold or the deadline passes; the last reading."""
        return self._poll(self.backend.gpus, lambda gpus: not self._over(gpus), deadline)

    def run(self, state: str = "present", check_mode: bool = False, wait: bool = True) -> dict:
        """List (state=present) or free the GPUs (state=absent). Raises ReclaimError when they stay busy."""
        started = time.monotonic()
        before = self.backend.gpus()
        targets = self.targets(before)
        if state == "absent":
            for t in targets:
                self.decide(t)
        chosen = [t for t in targets if t.action == "end"]
        result = dict(gpu_result(before), changed=bool(chosen), ended=[t.pid for t in chosen])
        if state == "present" or check_mode:
            for t in chosen:
                t.action = "would end"
            result["processes"] = [t.as_dict() for t in targets]
            verb = "would end" if chosen else "nothing to end;"
            result["msg"] = f"{len(before)} GPU(s), {len(targets)} process(es)" + (
                f"; {verb} {len(chosen)}" if state == "absent" else ""
            )
            return result

        stuck = self.end(chosen)
        for t in chosen:
            t.action = "ended" if t not in stuck else "end"
        after, over = before, []
        if wait:
            after = self.wait_for_memory(max(time.monotonic(), started + self.grace + self.timeout) if chosen else 0)
            over = self._over(after)
        elif chosen:
            after = self.backend.gpus()
        result.update(devices_after=devices(after), processes=[t.as_dict() for t in targets],
                      ended=[t.pid for t in chosen if t not in stuck])
        by_signal = {s: sum(t.signal == s for t in chosen) for s in ("SIGTERM", "SIGKILL")}
        summary = (
            f"ended {len(chosen) - len(stuck)} process(es) ({by_signal['SIGTERM']} with SIGTERM only, "
            f"{by_signal['SIGKILL']} needed SIGKILL)"
            if chosen
            else "nothing to end"
        )
        if stuck or over:
            result["msg"] = summary + "; " + self.busy_message(stuck, over, targets)
            raise ReclaimError(result["msg"], result)
        result["msg"] = summary + (f"; every GPU below {self.threshold // MIB} MiB" if wait else "")
        return result

    def busy_message(self, stuck: list[Target], over: list[Gpu], targets: list[Target]) -> str:
        """Name what still holds the GPUs, so the operator knows what to look at."""
        parts = []
        if stuck:
            parts.append("still alive after SIGKILL and the timeout: "
                         + ", ".join(f"pid {t.pid} ({t.info.cmdline})" for t in stuck))
        if over:
            pids = {p.pid for g in over for p in g.processes}
            held = "; ".join(
                f"pid {t.pid} {t.info.cmdline or '(not visible)'} "
                f"[{t.used_bytes // MIB if t.used_bytes is not None else '?'} MiB, {t.reason or 'exited?'}]"
                for t in targets if t.pid in pids and t not in stuck
            )
            waited = " after the timeout" if stuck or any(t.action == "ended" for t in targets) else ""
            parts.append(
                f"GPU memory at or above {self.threshold // MIB} MiB{waited}: "
                + ", ".join(f"GPU {g.index} {g.used_bytes // MIB} MiB" for g in over)
                + (f"; held by {held}" if held else "; no compute process listed (driver still releasing?)")
            )
        return "; ".join(parts)
