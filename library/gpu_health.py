#!/usr/bin/python
# Copyright: (c) 2026, hsx maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_health
short_description: Refuse to resume on a GPU that came back broken (the GPU health gate)
description:
    - Reads every NVIDIA GPU through NVML (nvidia-ml-py) and the NVIDIA driver's XID reports in the kernel log
      since boot, and fails when a GPU is unfit to run a long extraction on. What fails follows DCGM's health
      watches; each threshold is an option.
    - Fails on a GPU count other than O(expected_gpus); more than O(max_uncorrectable_ecc) uncorrectable ECC
      errors since the driver loaded; a pending page retirement (before Ampere) or a pending or failed row
      remap (Ampere and later); a PCIe link narrower than the GPU's maximum (O(pcie_width_must_be_max)); an
      XID of O(bad_xids) in the kernel log.
    - Warns (in RV(findings), without failing) where ECC is disabled, where the link cannot train to the
      GPU's PCIe generation, and where the kernel log cannot be read. The link's current generation is no
      finding, since an idle GPU lowers it to save power.
    - A reading NVML does not support on a GPU (page retirement on Hopper, the PCIe link in some VMs) is
      reported as null, never guessed.
    - Reads only; check mode runs the same reads. The logic lives in module_utils C(hsx.gpu_health).
version_added: "0.1.0"
author:
    - hsx maintainers (!UNKNOWN)
requirements:
    - python >= 3.10 on the managed host
    - nvidia-ml-py (C(import pynvml)) on the managed host, where an NVIDIA driver is installed
    - root on the managed host to read the kernel log (C(/dev/kmsg)); without it the XID check is a warning
options:
    expected_gpus:
        description: How many GPUs the host must have. Unset, any number but zero passes.
        type: int
    max_uncorrectable_ecc:
        description: Uncorrectable (volatile, since the driver loaded) ECC errors a GPU may have and still pass.
        type: int
        default: 0
    pcie_width_must_be_max:
        description: Fail a GPU whose PCIe link is narrower than its maximum width (a badly seated card or riser).
        type: bool
        default: true
    bad_xids:
        description:
            - The XIDs that fail the GPU they name when found in the kernel log since boot. The default lists
              those that mean the GPU itself is bad or needs a reset (double-bit and uncontained ECC, row
              remap failures, fallen off the bus, GSP errors, NVLink errors); application faults such as 13,
              31 and 43 are not in it.
        type: list
        elements: int
    require_gpus:
        description:
            - Fail when there is no NVIDIA driver or NVML cannot start. When false, such a host passes with
              RV(gpus) empty and a message saying why (a CPU node, the lab).
        type: bool
        default: false
extends_documentation_fragment:
  - hsx.recovery.attributes
attributes:
    check_mode:
        support: full
        details: Reads only; runs the same in check mode.
    diff_mode:
        support: none
        details: Nothing is changed, so there is nothing to diff.
    platform:
        details: Linux hosts with an NVIDIA driver.
notes:
    - The module never changes anything; it fails (C(failed=true)) when the gate does not pass, with every
      finding in the result, so a play stops that host before its job starts.
"""

EXAMPLES = r"""
- name: Refuse to resume on a broken GPU
  hsx.recovery.gpu_health:
    expected_gpus: 8

- name: Read the GPUs' health without failing (report only)
  hsx.recovery.gpu_health:
    expected_gpus: 8
  register: health
  ignore_errors: true
"""

RETURN = r"""
passed:
    description: Whether every GPU passed the gate.
    returned: always
    type: bool
gpus:
    description: Each GPU's readings (null where NVML does not report it on this GPU).
    returned: always
    type: list
    elements: dict
    sample:
        - {index: 0, name: NVIDIA H200, uuid: GPU-5f1c, pci_bus_id: "0000:18:00", ecc_enabled: true,
           ecc_uncorrectable_volatile: 0, ecc_correctable_volatile: 0, ecc_uncorrectable_aggregate: 0,
           retired_pages_pending: null, remapped_rows_uncorrectable: 0, remapped_rows_correctable: 0,
           remap_pending: false, remap_failed: false, pcie_gen: 1, pcie_gen_max: 5, pcie_gen_gpu_max: 5,
           pcie_width: 16, pcie_width_max: 16, pcie_replay_counter: 0, temperature_c: 31}
xids:
    description: The XID reports found in the kernel log since boot; null when the log could not be read.
    returned: always
    type: list
    elements: dict
    sample: [{pci_bus_id: "0000:18:00", xid: 79, line: "NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus."}]
findings:
    description: What the gate found, each with the GPU's index (null for the host), the check, fail or warn, and a sentence.
    returned: always
    type: list
    elements: dict
    sample: [{gpu: 3, check: ecc, severity: fail, message: "GPU 3: 2 uncorrectable ECC errors since the driver loaded"}]
msg:
    description: One line saying what was found.
    returned: always
    type: str
    sample: "8 GPUs healthy"
"""

import traceback

try:
    from ansible.module_utils.basic import AnsibleModule, missing_required_lib
except ImportError:  # The GPU machine has no Ansible: the core is used directly there.
    AnsibleModule = None
try:
    from ansible.module_utils.hsx import gpu_health
    from ansible.module_utils.hsx.nvml import NvmlUnavailable, PynvmlBackend, driver_present
except ImportError:  # Not run by Ansible: the same files, from the hsx package (module_utils/hsx).
    from hsx import gpu_health
    from hsx.nvml import NvmlUnavailable, PynvmlBackend, driver_present
try:
    import pynvml
except ImportError:
    pynvml = None
    PYNVML_IMPORT_ERROR = traceback.format_exc()
else:
    PYNVML_IMPORT_ERROR = None

ARGUMENT_SPEC = dict(
    expected_gpus=dict(type="int"),
    max_uncorrectable_ecc=dict(type="int", default=0),
    pcie_width_must_be_max=dict(type="bool", default=True),
    bad_xids=dict(type="list", elements="int"),
    require_gpus=dict(type="bool", default=False),
)


class GpuHealthModule:
    """The module: reads NVML and the kernel log, judges, and fails the task when the gate does not pass."""

    def __init__(self, module, nvml=None, kernel_log=None):
        self.module = module
        self.params = module.params
        self.nvml = nvml or pynvml
        self.kernel_log = kernel_log or gpu_health.kernel_log

    def policy(self) -> gpu_health.Policy:
        p = self.params
        if p["expected_gpus"] is not None and p["expected_gpus"] < 0:
            self.module.fail_json(msg=f"expected_gpus must be >= 0, not {p['expected_gpus']}")
        bad = gpu_health.BAD_XIDS if p["bad_xids"] is None else tuple(p["bad_xids"])
        return gpu_health.Policy(p["expected_gpus"], p["max_uncorrectable_ecc"], p["pcie_width_must_be_max"], bad)

    def no_gpu(self, reason: str) -> dict:
        if self.params["require_gpus"] or self.params["expected_gpus"]:
            self.module.fail_json(msg=f"GPU health: {reason}", passed=False, gpus=[], xids=None, findings=[])
        return {"changed": False, "passed": True, "gpus": [], "xids": None, "findings": [], "msg": f"no GPU: {reason}"}

    def run(self) -> dict:
        policy = self.policy()
        if self.nvml is None:
            if self.params["require_gpus"] or driver_present():
                self.module.fail_json(msg=missing_required_lib("nvidia-ml-py"), exception=PYNVML_IMPORT_ERROR)
            return self.no_gpu("no NVIDIA driver installed (and nvidia-ml-py is not installed)")
        try:
            backend = PynvmlBackend(self.nvml)
        except NvmlUnavailable as e:
            return self.no_gpu(str(e))
        try:
            gpus = gpu_health.read_health(self.nvml)
        finally:
            backend.close()
        lines = self.kernel_log()
        xids = None if lines is None else gpu_health.read_xids(lines)
        findings = gpu_health.judge(gpus, xids, policy)
        result = dict(gpu_health.report(gpus, xids, findings), changed=False)
        failing = [f.message for f in findings if f.severity == "fail"]
        if failing:
            self.module.fail_json(msg="GPU health gate failed: " + "; ".join(failing), **result)
        warnings = [f.message for f in findings if f.severity == "warn"]
        result["msg"] = f"{len(gpus)} GPUs healthy" + (f" ({'; '.join(warnings)})" if warnings else "")
        return result


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    module.exit_json(**GpuHealthModule(module).run())


if __name__ == "__main__":
    main()
