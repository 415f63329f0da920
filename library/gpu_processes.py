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
    - The logic lives in the class C(GpuReclaimer) (module_utils C(hsx.gpu_reclaim)), which reads NVML through
      module_utils C(hsx.nvml). This file imports without Ansible (those then come from the hsx package), so the
      same code runs on a GPU machine that has no Ansible (see C(tests/gpu/test_gpu_reclaim.py)).
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
extends_documentation_fragment:
  - hsx.recovery.attributes
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

import re
import traceback

try:
    from ansible.module_utils.basic import AnsibleModule, missing_required_lib
except ImportError:  # The GPU machine has no Ansible: GpuReclaimer is used directly there.
    AnsibleModule = None
# The NVML interface, the decisions and signals, and what /proc says live in module_utils/hsx (nvml,
# gpu_reclaim, procfs).
try:
    from ansible.module_utils.hsx.nvml import NvmlUnavailable, driver_present, gpu_result
    from ansible.module_utils.hsx.nvml import PynvmlBackend as NvmlBackend
except ImportError:  # Not run by Ansible: the same file, from the hsx package (module_utils/hsx).
    from hsx.nvml import NvmlUnavailable, driver_present, gpu_result
    from hsx.nvml import PynvmlBackend as NvmlBackend
try:
    from ansible.module_utils.hsx.gpu_reclaim import GpuReclaimer, ReclaimError
except ImportError:  # Not run by Ansible: the same file, from the hsx package (module_utils/hsx).
    from hsx.gpu_reclaim import GpuReclaimer, ReclaimError
# Not used here: for the code that loads this file without Ansible (tests/unit, tests/gpu) and finds them in it.
try:
    from ansible.module_utils.hsx.nvml import Gpu, GpuProc  # noqa: F401  # pylint: disable=unused-import
    from ansible.module_utils.hsx.procfs import ProcTable  # noqa: F401  # pylint: disable=unused-import
except ImportError:  # Not run by Ansible: the same files, from the hsx package (module_utils/hsx).
    from hsx.nvml import Gpu, GpuProc  # noqa: F401  # pylint: disable=unused-import
    from hsx.procfs import ProcTable  # noqa: F401  # pylint: disable=unused-import

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


class PynvmlBackend(NvmlBackend):
    """hsx.nvml's backend on this host's nvidia-ml-py: `nvml` defaults to the `pynvml` imported
    above (looked up when called), since the stdlib-only core never imports it itself."""

    def __init__(self, nvml=None):
        super().__init__(nvml or pynvml)


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
