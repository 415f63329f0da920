#!/usr/bin/python
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

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
      in this namespace.
    - Processes of the systemd units in O(protect_units) (read from C(/proc/PID/cgroup)) are never ended,
      whatever O(force) says.
    - On a host without an NVIDIA driver (NVML cannot start, or nvidia-ml-py is missing and no driver is
      installed) the result is C(gpus=0) and nothing fails, unless O(require_gpus=true).
    - The logic lives in the class C(GpuReclaimer), which imports without Ansible, so the same code runs on a
      GPU machine that has no Ansible (see C(tests/gpu/test_gpu_reclaim.py)).
version_added: "0.1.0"
author:
    - hsx maintainers
requirements:
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
              joined by single spaces). A process matching any of them is ended with O(state=absent).
            - With O(state=absent) either O(patterns) or O(force=true) is required.
        type: list
        elements: str
        default: []
    force:
        description:
            - End every visible GPU process, whatever its command line (still never those of O(protect_units)).
        type: bool
        default: false
    protect_units:
        description:
            - systemd unit names (for example V(hsx-sglang-server.service)) whose processes are never ended.
        type: list
        elements: str
        default: []
    grace_seconds:
        description:
            - Seconds between SIGTERM and SIGKILL.
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
        type: bool
        default: false
attributes:
    check_mode:
        support: full
        details: Lists what would be ended (RV(processes[].action=would end)) and signals nothing.
    diff_mode:
        support: none
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
    sample: []
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
            description: Command line, arguments joined by spaces (null when not visible)
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

import ctypes.util  # noqa: E402
import os  # noqa: E402
import pwd  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

try:
    from ansible.module_utils.basic import AnsibleModule, missing_required_lib
except ImportError:  # The GPU machine has no Ansible: GpuReclaimer is used directly there.
    AnsibleModule = None

try:
    import pynvml
except ImportError:
    pynvml = None
    PYNVML_IMPORT_ERROR = traceback.format_exc()
else:
    PYNVML_IMPORT_ERROR = None

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


class PynvmlBackend:
    """The only code that talks to NVML: `gpus()` returns plain data (tests use a fake instead)."""

    def __init__(self, nvml=None):
        self.nvml = nvml or pynvml
        try:
            self.nvml.nvmlInit()
        except self.nvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML could not start: {e}") from e

    def _text(self, value) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

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
            out.append(
                Gpu(
                    index=index,
                    name=self._text(n.nvmlDeviceGetName(handle)),
                    uuid=self._text(n.nvmlDeviceGetUUID(handle)),
                    used_bytes=int(mem.used),
                    total_bytes=int(mem.total),
                    utilization=util,
                    processes=procs,
                )
            )
        return out

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


def driver_present() -> bool:
    """An NVIDIA driver is installed here (so a missing nvidia-ml-py is an error, not 'no GPU')."""
    return os.path.exists("/proc/driver/nvidia/version") or bool(ctypes.util.find_library("nvidia-ml"))


# ---------------------------------------------------------------- /proc
@dataclass
class ProcInfo:
    """What /proc says about a pid NVML reported."""

    visible: bool
    start_time: str | None = None
    user: str | None = None
    cmdline: str | None = None
    unit: str | None = None
    holds_device: bool | None = None


class ProcTable:
    """Reads processes from /proc; `device_prefix` is what an open GPU device's path starts with."""

    def __init__(self, root: str = "/proc", device_prefix: str | None = None):
        self.root = root
        self.device_prefix = device_prefix or DEVICE_PREFIX

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
            cmdline = " ".join(a for a in argv if a) or f"[{self._read(pid, 'comm').strip()}]"
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
        return {
            "pid": self.pid,
            "visible": self.info.visible,
            "user": self.info.user,
            "cmdline": self.info.cmdline,
            "unit": self.info.unit,
            "gpus": self.gpus,
            "used_memory_mib": None if self.used_bytes is None else self.used_bytes // MIB,
            "holds_device": self.info.holds_device,
            "action": self.action,
            "reason": self.reason,
            "signal": self.signal,
        }


class GpuReclaimer:
    """Finds GPU processes, decides which may be ended, ends them (TERM, then KILL) and waits for memory."""

    def __init__(
        self,
        backend,
        patterns: list[str] = (),
        force: bool = False,
        protect_units: list[str] = (),
        grace_seconds: float = 15,
        timeout_seconds: float = 60,
        memory_threshold_mib: int = 2048,
        procs: ProcTable | None = None,
        poll_seconds: float = 0.2,
    ):
        self.backend = backend
        self.patterns = [(p, re.compile(p)) for p in patterns]
        self.force = force
        self.protect_units = set(protect_units)
        self.grace = grace_seconds
        self.timeout = timeout_seconds
        self.threshold = memory_threshold_mib * MIB
        self.procs = procs or ProcTable()
        self.poll = poll_seconds

    @staticmethod
    def devices(gpus: list[Gpu]) -> list[dict]:
        return [
            {
                "index": g.index,
                "name": g.name,
                "uuid": g.uuid,
                "memory_used_mib": g.used_bytes // MIB,
                "memory_total_mib": g.total_bytes // MIB,
                "utilization_percent": g.utilization,
                "pids": sorted({p.pid for p in g.processes}),
            }
            for g in gpus
        ]

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
            t.reason = (
                "pid not visible here (another PID namespace or container, or already gone): not touched"
            )
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

    def _wait_gone(self, targets: list[Target], deadline: float) -> list[Target]:
        """Poll until every target has exited or the deadline passes; the ones still alive."""
        while True:
            alive = [t for t in targets if self.procs.alive(t.pid, t.info.start_time)]
            if not alive or time.monotonic() >= deadline:
                return alive
            time.sleep(self.poll)

    def end(self, targets: list[Target]) -> list[Target]:
        """SIGTERM, SIGKILL after the grace period; returns those still alive after the timeout."""
        for t in targets:
            self._signal(t, signal.SIGTERM)
        survivors = self._wait_gone(targets, time.monotonic() + self.grace)
        for t in survivors:
            self._signal(t, signal.SIGKILL)
        return self._wait_gone(survivors, time.monotonic() + self.timeout)

    def _over(self, gpus: list[Gpu]) -> list[Gpu]:
        return [g for g in gpus if g.used_bytes >= self.threshold]

    def wait_for_memory(self, deadline: float) -> list[Gpu]:
        """Poll NVML until every GPU is below the threshold or the deadline passes; the last reading."""
        while True:
            gpus = self.backend.gpus()
            if not self._over(gpus) or time.monotonic() >= deadline:
                return gpus
            time.sleep(self.poll)

    def run(self, state: str = "present", check_mode: bool = False, wait: bool = True) -> dict:
        """List (state=present) or free the GPUs (state=absent). Raises ReclaimError when they stay busy."""
        started = time.monotonic()
        before = self.backend.gpus()
        targets = self.targets(before)
        if state == "absent":
            for t in targets:
                self.decide(t)
        chosen = [t for t in targets if t.action == "end"]
        result = {
            "changed": bool(chosen),
            "gpus": len(before),
            "nvml": "ok",
            "devices": self.devices(before),
            "devices_after": self.devices(before),
            "processes": [],
            "ended": [t.pid for t in chosen],
        }
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
        after = before
        over: list[Gpu] = []
        if wait:
            after = self.wait_for_memory(
                max(time.monotonic(), started + self.grace + self.timeout) if chosen else 0
            )
            over = self._over(after)
        elif chosen:
            after = self.backend.gpus()
        result["devices_after"] = self.devices(after)
        result["processes"] = [t.as_dict() for t in targets]
        result["ended"] = [t.pid for t in chosen if t not in stuck]
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
            parts.append(
                "still alive after SIGKILL and the timeout: "
                + ", ".join(f"pid {t.pid} ({t.info.cmdline})" for t in stuck)
            )
        if over:
            pids = {p.pid for g in over for p in g.processes}
            holders = [t for t in targets if t.pid in pids and t not in stuck]
            gpu_text = ", ".join(f"GPU {g.index} {g.used_bytes // MIB} MiB" for g in over)
            held = "; ".join(
                f"pid {t.pid} {t.info.cmdline or '(not visible)'} "
                f"[{t.used_bytes // MIB if t.used_bytes is not None else '?'} MiB, {t.reason or 'exited?'}]"
                for t in holders
            )
            parts.append(
                f"GPU memory at or above {self.threshold // MIB} MiB{' after the timeout' if stuck or any(t.action == 'ended' for t in targets) else ''}: {gpu_text}"
                + (f"; held by {held}" if held else "; no compute process listed (driver still releasing?)")
            )
        return "; ".join(parts)


# ---------------------------------------------------------------- the module
def no_gpu_result(reason: str) -> dict:
    return {
        "changed": False,
        "gpus": 0,
        "nvml": reason,
        "devices": [],
        "devices_after": [],
        "processes": [],
        "ended": [],
        "msg": f"no GPU: {reason}",
    }


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "state": {"type": "str", "choices": ["present", "absent"], "default": "present"},
            "patterns": {"type": "list", "elements": "str", "default": []},
            "force": {"type": "bool", "default": False},
            "protect_units": {"type": "list", "elements": "str", "default": []},
            "grace_seconds": {"type": "float", "default": 15},
            "timeout_seconds": {"type": "float", "default": 60},
            "memory_threshold_mib": {"type": "int", "default": 2048},
            "wait": {"type": "bool", "default": True},
            "require_gpus": {"type": "bool", "default": False},
        },
        supports_check_mode=True,
    )
    p = module.params
    if p["state"] == "absent" and not p["patterns"] and not p["force"]:
        module.fail_json(msg="state=absent needs patterns (an allowlist) or force=true")
    for pattern in p["patterns"]:
        try:
            re.compile(pattern)
        except re.error as e:
            module.fail_json(msg=f"patterns: {pattern!r} is not a valid regular expression: {e}")
    for name in ("grace_seconds", "timeout_seconds", "memory_threshold_mib"):
        if p[name] < 0:
            module.fail_json(msg=f"{name} must be >= 0, not {p[name]}")

    if pynvml is None:
        if p["require_gpus"] or driver_present():
            module.fail_json(msg=missing_required_lib("nvidia-ml-py"), exception=PYNVML_IMPORT_ERROR)
        module.exit_json(**no_gpu_result("no NVIDIA driver installed (and nvidia-ml-py is not installed)"))
    try:
        backend = PynvmlBackend()
    except NvmlUnavailable as e:
        if p["require_gpus"]:
            module.fail_json(**dict(no_gpu_result(str(e)), msg=f"require_gpus: {e}"))
        module.exit_json(**no_gpu_result(str(e)))
    try:
        reclaimer = GpuReclaimer(
            backend,
            patterns=p["patterns"],
            force=p["force"],
            protect_units=p["protect_units"],
            grace_seconds=p["grace_seconds"],
            timeout_seconds=p["timeout_seconds"],
            memory_threshold_mib=p["memory_threshold_mib"],
        )
        try:
            result = reclaimer.run(p["state"], module.check_mode, p["wait"])
        except ReclaimError as e:
            module.fail_json(**e.result)
        except PermissionError as e:
            module.fail_json(msg=f"not permitted to signal a GPU process ({e}); run with become=true")
    finally:
        backend.close()
    if p["require_gpus"] and result["gpus"] == 0:
        module.fail_json(**dict(result, msg="require_gpus: NVML works but lists no GPU"))
    module.exit_json(**result)


if __name__ == "__main__":
    main()
