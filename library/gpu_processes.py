#!/usr/bin/python
# Copyright: (c) 2026, hsx maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_processes
short_description: List the processes holding NVIDIA GPUs, and end the allowlisted ones
description:
    - Lists GPU compute processes through NVML (nvidia-ml-py) with pid, user, command line, systemd unit, GPU
      indexes and used memory; and per GPU its memory used/total and utilisation.
    - With O(state=absent), ends the processes whose command line matches one of O(patterns) (or all of
      them with O(force=true)) with SIGTERM first, SIGKILL to those still alive after O(grace_seconds), then waits
      until every GPU's used memory is below O(memory_threshold_mib). If that does not happen within
      O(timeout_seconds) the module fails and lists what still holds memory.
    - A process is ended only when it is visible here (its pid exists in this PID namespace, it is not a
      zombie, its start time has not changed since it was listed) and it holds an NVIDIA device open
      (C(/dev/nvidia*) among its file descriptors). A pid NVML reports that is not visible here (a process in
      another container) is reported as such and never signalled, since the number may name a different process
      in this namespace. What /proc says about a pid is read by module_utils C(hsx.procfs).
    - Command lines are redacted as they are read (module_utils C(hsx.redact), docs/security.md). The values of
      flags and variables named like key, token, secret, password, passwd or credential
      (C(--api-key K), C(--hf-token=K), C(HF_TOKEN=K)), credentials in URLs and bearer tokens read
      C(<redacted>) in every result and message, and O(patterns) are matched against the redacted line.
    - The logic lives in the class C(GpuReclaimer), which imports without Ansible (C(hsx.procfs) then comes
      from the hsx package), so the same code runs on a GPU machine that has no Ansible (see
      C(tests/gpu/test_gpu_reclaim.py)).
version_added: "0.1.0"
author:
    - hsx maintainers (!UNKNOWN)
requirements:
    - python >= 3.10 on the managed host
    - nvidia-ml-py (C(import pynvml)) on the managed host, where an NVIDIA driver is installed
options:
    state:
        description:
            - V(present) lists the processes and GPUs and changes nothing.
            - V(absent) ends the matching processes (see O(patterns), O(force)).
        type: str
        choices: [ present, absent ]
        default: present
    patterns:
        description:
            - Python regular expressions searched (C(re.search)) in each process's command line (arguments
              joined by single spaces, secrets redacted). A process matching any of them is ended with O(state=absent).
            - With O(state=absent) either O(patterns) or O(force=true) is required.
        type: list
        elements: str
        default: []
    force:
        description: End every visible GPU process, whatever its command line (still never those of O(protect_units)).
        type: bool
        default: false
    protect_units:
        description:
            - systemd unit names (for example V(hsx-sglang-server.service)) whose processes (by C(/proc/PID/cgroup))
              are never ended, whatever O(force) says.
        type: list
        elements: str
        default: []
    grace_seconds:
        description: Seconds between SIGTERM and SIGKILL.
        type: float
        default: 15
    timeout_seconds:
        description:
            - After the signals, how long to wait for the ended processes to disappear and for every GPU's used
              memory to fall below O(memory_threshold_mib).
        type: float
        default: 60
    memory_threshold_mib:
        description:
            - A GPU counts as free when its used memory (MiB, as NVML reports it, which includes the driver's
              reservation of a few hundred MiB) is below this.
        type: int
        default: 2048
    wait:
        description:
            - With O(state=absent), wait for the memory to fall below the threshold (and fail if it does not).
              With V(false) the module returns right after the signals.
        type: bool
        default: true
    require_gpus:
        description:
            - Fail when there is no NVIDIA driver, NVML cannot start, nvidia-ml-py is missing or no GPU is found.
            - Without it, a host without an NVIDIA driver (NVML cannot start, or nvidia-ml-py is missing and no
              driver is installed) returns RV(gpus=0) and nothing fails.
        type: bool
        default: false
attributes:
    check_mode:
        description: Can run in check_mode and return changed status prediction without modifying target.
        support: full
        details: Lists what would be ended (RV(processes[].action=would end)) and signals nothing.
    diff_mode:
        description: Will return details on what has changed (or possibly needs changing in check_mode), when in diff mode.
        support: none
    platform:
        description: Target OS/families that can be operated against.
        support: full
        platforms: posix
notes:
    - Ending other users' processes needs root (C(become=true)).
    - Only compute processes are listed (C(nvmlDeviceGetComputeRunningProcesses)); graphics contexts are not.
seealso:
    - module: ansible.builtin.systemd_service
"""

EXAMPLES = r"""
- name: List GPU processes and memory (assessment)
  gpu_processes:
  register: gpu

- name: End stray vLLM/SGLang processes, but never our own server's
  gpu_processes:
    state: absent
    patterns:
      - '\bvllm\b'
      - 'sglang\.launch_server'
    protect_units:
      - hsx-sglang-server.service
    grace_seconds: 20
    timeout_seconds: 120
  become: true

- name: Take every GPU back, whatever holds it
  gpu_processes:
    state: absent
    force: true
  become: true

- name: Fail on a node that should have GPUs but has no working driver
  gpu_processes:
    require_gpus: true
"""

RETURN = r"""
gpus:
    description: Number of GPUs NVML reports (0 without a driver).
    returned: always
    type: int
    sample: 8
nvml:
    description: Why no GPU is listed (NVML error, missing driver), or V(ok).
    returned: always
    type: str
    sample: ok
devices:
    description: Each GPU before anything was ended.
    returned: always
    type: list
    elements: dict
    contains:
        index:
            description: NVML index
            type: int
        name:
            description: Product name
            type: str
        uuid:
            description: GPU UUID
            type: str
        memory_used_mib:
            description: Used memory, MiB
            type: int
        memory_total_mib:
            description: Total memory, MiB
            type: int
        utilization_percent:
            description: GPU utilisation (null where NVML does not support it)
            type: int
        pids:
            description: Compute processes on this GPU
            type: list
            elements: int
    sample:
        - {index: 0, name: NVIDIA H200, uuid: GPU-5f1c..., memory_used_mib: 76810, memory_total_mib: 143771,
           utilization_percent: 0, pids: [4012]}
devices_after:
    description: Each GPU at the end (same as RV(devices) unless processes were ended).
    returned: always
    type: list
    elements: dict
processes:
    description: Every GPU compute process NVML reports, one entry per pid, with what was done to it.
    returned: always
    type: list
    elements: dict
    contains:
        pid:
            description: Process id as NVML reports it
            type: int
        visible:
            description: The pid exists here (same PID namespace) and is not a zombie
            type: bool
        user:
            description: Owner (null when not visible)
            type: str
        cmdline:
            description: Command line, arguments joined by spaces, secret values redacted (null when not visible)
            type: str
        unit:
            description: systemd unit the process runs in, if any
            type: str
        gpus:
            description: GPU indexes it uses
            type: list
            elements: int
        used_memory_mib:
            description: GPU memory it uses, MiB (null where NVML does not say)
            type: int
        holds_device:
            description: Has /dev/nvidia* open (null if its descriptors cannot be read)
            type: bool
        action:
            description: V(end), V(would end) (check mode), V(ended), V(keep) or V(none) (O(state=present)).
            type: str
        reason:
            description: Why it is ended or kept
            type: str
        signal:
            description: The last signal sent (V(SIGTERM) or V(SIGKILL)), or null
            type: str
    sample:
        - {pid: 4012, visible: true, user: root, unit: vllm-kimi-k25-int4.service,
           cmdline: "python3 -m vllm.entrypoints.openai.api_server --model /models/k25", gpus: [0, 1],
           used_memory_mib: 153600, holds_device: true, action: ended, reason: "matches '\\bvllm\\b'",
           signal: SIGTERM}
ended:
    description: Pids that were ended (or would be, in check mode).
    returned: always
    type: list
    elements: int
    sample: [4012]
msg:
    description: One line saying what happened.
    returned: always
    type: str
    sample: "ended 1 process(es) (1 with SIGTERM only, 0 needed SIGKILL); every GPU below 2048 MiB"
"""

import ctypes.util
import os
import re
import signal
import time
import traceback
from dataclasses import dataclass, field

try:
    from ansible.module_utils.basic import AnsibleModule, missing_required_lib
except ImportError:  # The GPU machine has no Ansible: GpuReclaimer is used directly there.
    AnsibleModule = None
try:
    from ansible.module_utils.hsx.procfs import ProcInfo, ProcTable
except ImportError:  # Not run by Ansible: the same file, from the hsx package (module_utils/hsx).
    from hsx.procfs import ProcInfo, ProcTable

try:
    import pynvml
except ImportError:
    pynvml = None
    PYNVML_IMPORT_ERROR = traceback.format_exc()
else:
    PYNVML_IMPORT_ERROR = None

ARGUMENT_SPEC = dict(
    state=dict(type="str", default="present", choices=["present", "absent"]),
    patterns=dict(type="list", default=[], elements="str"),
    force=dict(type="bool", default=False),
    protect_units=dict(type="list", default=[], elements="str"),
    grace_seconds=dict(type="float", default=15),
    timeout_seconds=dict(type="float", default=60),
    memory_threshold_mib=dict(type="int", default=2048),
    wait=dict(type="bool", default=True),
    require_gpus=dict(type="bool", default=False),
)
MIB = 1 << 20
# What an open NVIDIA device file's path starts with (/dev/nvidia0, /dev/nvidiactl, /dev/nvidia-uvm).
DEVICE_PREFIX = "/dev/nvidia"


class NvmlUnavailable(Exception):
    """NVML cannot start here (no driver, no libnvidia-ml, driver/library mismatch)."""


class ReclaimError(Exception):
    """The GPUs could not be freed; `result` holds everything known at that point."""

    def __init__(self, msg: str, result: dict):
        super().__init__(msg)
        self.result = result


# ---------------------------------------------------------------- the NVML interface
@dataclass
class GpuProc:
    """One compute process on one GPU as NVML reports it."""

    pid: int
    used_bytes: int | None


@dataclass
class Gpu:
    """One GPU's state at one moment."""

    index: int
    name: str
    uuid: str
    used_bytes: int
    total_bytes: int
    utilization: int | None
    processes: list[GpuProc] = field(default_factory=list)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class PynvmlBackend:
    """The only code that talks to NVML: `gpus()` returns plain data (tests use a fake instead)."""

    def __init__(self, nvml=None):
        self.nvml = nvml or pynvml
        try:
            self.nvml.nvmlInit()
        except self.nvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML could not start: {e}") from e

    def gpus(self) -> list[Gpu]:
        n = self.nvml
        out = []
        for index in range(n.nvmlDeviceGetCount()):
            handle = n.nvmlDeviceGetHandleByIndex(index)
            mem = n.nvmlDeviceGetMemoryInfo(handle)
            try:
                util = int(n.nvmlDeviceGetUtilizationRates(handle).gpu)
            except n.NVMLError:  # not supported (MIG) or not permitted
                util = None
            procs = []
            for p in n.nvmlDeviceGetComputeRunningProcesses(handle):
                used = getattr(p, "usedGpuMemory", None)
                procs.append(GpuProc(int(p.pid), int(used) if isinstance(used, int) else None))
            out.append(Gpu(index, _text(n.nvmlDeviceGetName(handle)), _text(n.nvmlDeviceGetUUID(handle)),
                           int(mem.used), int(mem.total), util, procs))
        return out

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


def driver_present() -> bool:
    """An NVIDIA driver is installed here (so a missing nvidia-ml-py is an error, not 'no GPU')."""
    return os.path.exists("/proc/driver/nvidia/version") or bool(ctypes.util.find_library("nvidia-ml"))


def devices(gpus: list[Gpu]) -> list[dict]:
    """The RV(devices) of a reading."""
    return [
        {"index": g.index, "name": g.name, "uuid": g.uuid, "memory_used_mib": g.used_bytes // MIB,
         "memory_total_mib": g.total_bytes // MIB, "utilization_percent": g.utilization,
         "pids": sorted({p.pid for p in g.processes})}
        for g in gpus
    ]


def gpu_result(gpus: list[Gpu], nvml: str = "ok", msg: str = "") -> dict:
    """The module's result for a reading before anything is done (every key the module returns)."""
    return {"changed": False, "gpus": len(gpus), "nvml": nvml, "devices": devices(gpus),
            "devices_after": devices(gpus), "processes": [], "ended": [], "msg": msg}


# ---------------------------------------------------------------- the logic
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

    def __init__(self, backend, patterns: list[str] = (), force: bool = False, protect_units: list[str] = (),
                 grace_seconds: float = 15, timeout_seconds: float = 60, memory_threshold_mib: int = 2048,
                 procs: ProcTable | None = None, poll_seconds: float = 0.2):
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

    def _poll(self, read, done, deadline: float):
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


# ---------------------------------------------------------------- the module
class GpuProcessesModule:
    """The module: checks the arguments, lists the GPUs through NVML (or reports that there are none)
    and runs GpuReclaimer with the task's arguments; in check mode it signals nothing."""

    def __init__(self, module):
        self.module = module
        self.params = module.params

    def check_arguments(self) -> None:
        p = self.params
        if p["state"] == "absent" and not p["patterns"] and not p["force"]:
            self.module.fail_json(msg="state=absent needs patterns (an allowlist) or force=true")
        for pattern in p["patterns"]:
            try:
                re.compile(pattern)
            except re.error as e:
                self.module.fail_json(msg=f"patterns: {pattern!r} is not a valid regular expression: {e}")
        for name in ("grace_seconds", "timeout_seconds", "memory_threshold_mib"):
            if p[name] < 0:
                self.module.fail_json(msg=f"{name} must be >= 0, not {p[name]}")

    def run(self) -> dict:
        p = self.params
        self.check_arguments()
        if pynvml is None:
            if p["require_gpus"] or driver_present():
                self.module.fail_json(msg=missing_required_lib("nvidia-ml-py"), exception=PYNVML_IMPORT_ERROR)
            reason = "no NVIDIA driver installed (and nvidia-ml-py is not installed)"
            return gpu_result([], reason, f"no GPU: {reason}")
        try:
            backend = PynvmlBackend()
        except NvmlUnavailable as e:
            if p["require_gpus"]:
                self.module.fail_json(**gpu_result([], str(e), f"require_gpus: {e}"))
            return gpu_result([], str(e), f"no GPU: {e}")
        options = ("patterns", "force", "protect_units", "grace_seconds", "timeout_seconds", "memory_threshold_mib")
        try:
            result = GpuReclaimer(backend, **{k: p[k] for k in options}).run(p["state"], self.module.check_mode, p["wait"])
        except ReclaimError as e:
            self.module.fail_json(**e.result)
        except PermissionError as e:
            self.module.fail_json(msg=f"not permitted to signal a GPU process ({e}); run with become=true")
        finally:
            backend.close()
        if p["require_gpus"] and result["gpus"] == 0:
            self.module.fail_json(**dict(result, msg="require_gpus: NVML works but lists no GPU"))
        return result


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    module.exit_json(**GpuProcessesModule(module).run())


if __name__ == "__main__":
    main()
