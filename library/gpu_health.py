#!/usr/bin/python
# Copyright: (c) 2026, hsx maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_health
short_description: Refuse to resume on a GPU that came back broken (the GPU health gate)
description:
    - Reads every NVIDIA GPU through NVML (nvidia-ml-py) and the NVIDIA driver's XID reports since boot, and fails
      when a GPU is unfit to run a long extraction on. What fails follows DCGM's health watches; each threshold is
      an option. Where DCGM is installed it also runs its diagnostic (C(dcgmi diag -r 1)), an active check.
    - An XID counts only from the driver's own records - the kernel's facility, the driver's prefix (C(NVRM), C(Xid),
      the PCI address, the number) at the start of the message, the address of a GPU of this node (from NVML,
      C(/proc/driver/nvidia/gpus) and C(/sys/bus/pci/drivers/nvidia)) - so text a user gets into the kernel log
      cannot fail a healthy node. XIDs are read from the ring buffer (C(/dev/kmsg)) and from journald's kernel
      records of this boot (C(journalctl -k -b)), and those seen are kept in O(xid_record_dir) for the rest of the
      boot, so a flood that pushes an XID out of the ring buffer cannot hide it once the gate has seen it.
    - Fails on a GPU count other than O(expected_gpus); more than O(max_uncorrectable_ecc) uncorrectable ECC
      errors since the driver loaded; a pending page retirement (before Ampere) or a pending or failed row
      remap (Ampere and later); a PCIe link narrower than the GPU's maximum (O(pcie_width_must_be_max)); an
      XID of O(bad_xids) since boot; an XID record in O(xid_record_dir) that is not the gate's (a link, another
      owner, not its format); a failing DCGM diagnostic (O(dcgm_diag)); the NVIDIA kernel driver loaded but NVML
      unable to start (a driver/library version mismatch).
    - Warns (in RV(findings), without failing) where ECC is disabled, where the link cannot train to the
      GPU's PCIe generation, where the kernel log cannot be read, where records posed as XIDs and were ignored,
      and where the ring buffer lost records of this boot that no journal holds. The link's current generation is no
      finding, since an idle GPU lowers it to save power.
    - A reading NVML does not support on a GPU (page retirement on Hopper, the PCIe link in some VMs) is
      reported as null, never guessed.
    - Reads the GPUs and logs only; writes nothing but its XID record (C(changed) when a new XID was recorded;
      check mode reads the same but records nothing). The logic lives in module_utils C(hsx.gpu_health),
      C(hsx.xidlog) and C(hsx.dcgm).
version_added: "0.1.0"
author:
    - hsx maintainers (!UNKNOWN)
requirements:
    - python >= 3.10 on the managed host
    - nvidia-ml-py (C(import pynvml)) on the managed host, where an NVIDIA driver is installed
    - root on the managed host to read the kernel log (C(/dev/kmsg)); without it the XID check is a warning
    - NVIDIA DCGM (C(dcgmi)) on the managed host for the active check; without it the result says so
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
            - Fail when there is no NVIDIA driver or NVML cannot start. When false, a host without the NVIDIA
              kernel driver passes with RV(gpus) empty and a message saying why (a CPU node, the lab); where the
              driver is loaded (C(/proc/driver/nvidia), C(/sys/module/nvidia) or a C(/dev/nvidiaN) node) NVML
              failing to start always fails, with NVML's error.
        type: bool
        default: false
    xid_record_dir:
        description:
            - Where the gate keeps the XIDs it saw in this boot (C(xids.json), keyed by the boot id), so one pushed
              out of the kernel's ring buffer still fails the gate. Made 0700 when absent; must be a directory of
              root that no one else may write (not the C(hsx) account's C(/var/lib/hsx)). Empty keeps no record.
        type: path
        default: /var/lib/hsx-gpu-health
    journal:
        description: Also read journald's kernel records of this boot (C(journalctl -k -b)), which outlive the ring buffer.
        type: bool
        default: true
    dcgm_diag:
        description:
            - The active check, NVIDIA DCGM's diagnostic C(dcgmi diag -r LEVEL -j), run when every other check passed.
              V(auto) runs it where C(dcgmi) is found and says in RV(dcgm) that it is absent otherwise (not a
              failure); V(required) fails a GPU host without it; V(off) never runs it.
            - A non-zero exit, a test that says Fail, a runtime error or the timeout fails the gate, naming the
              failed tests. DCGM's verdicts are taken as they are (a software test may fail on a setting, such
              as persistence mode, in some releases - fix it, or turn the check off).
        type: str
        choices: [auto, required, "off"]
        default: auto
    dcgm_diag_level:
        description:
            - The diagnostic's level. 1 takes seconds (deployment checks). NVIDIA positions level 2 (about 2
              minutes, the memory and PCIe tests) as the check after a failure; 3 and 4 (tens of minutes to hours) are
              for an administrator. Levels above 1 stress the GPUs, which must be free.
        type: int
        choices: [1, 2, 3, 4]
        default: 1
    dcgm_diag_timeout:
        description: Seconds the diagnostic may run before it is stopped and the gate fails; unset, by level (1 300, 2 900, 3 3600, 4 10800).
        type: int
    dcgmi_path:
        description: The C(dcgmi) to run; unset, C(dcgmi) on the PATH.
        type: path
seealso:
  - module: hsx.recovery.gpu_processes
    description: Lists and ends the processes holding the GPUs, before this gate judges them.
  - module: hsx.recovery.service_health
    description: Waits for the SGLang server to answer once the GPUs are judged fit.
extends_documentation_fragment:
  - hsx.recovery.attributes
attributes:
    check_mode:
        support: full
        details: Runs the same reads in check mode; records no new XID there.
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

- name: The gate with DCGM's level-2 diagnostic (about 2 minutes), as after a failure
  hsx.recovery.gpu_health:
    expected_gpus: 8
    dcgm_diag: required
    dcgm_diag_level: 2

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
    description:
        - The driver's XID reports since boot (each GPU and number once), from the kernel log, the journal and the
          gate's record; null when none of them could be read.
    returned: always
    type: list
    elements: dict
    sample: [{pci_bus_id: "0000:18:00", xid: 79, line: "NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus."}]
xid_sources:
    description: Where XIDs were read from (V(kmsg), V(journal), V(record)); empty when none could be read.
    returned: always
    type: list
    elements: str
    sample: [kmsg, journal]
xids_ignored:
    description: Kernel log records that mentioned an XID but were not the driver's own report for a GPU of this node.
    returned: always
    type: int
    sample: 0
dcgm:
    description:
        - The active check. C(state) is V(passed) or V(failed) (it ran), V(absent) (no C(dcgmi)), V(off), or
          V(skipped) (no GPU, or another check already failed); with C(level), C(message), C(failed_tests),
          C(seconds) and C(rc) where it ran.
    returned: always
    type: dict
    sample: {state: passed, level: 1, message: "dcgmi diag -r 1 passed (1 tests, 6.2 s)", failed_tests: [], seconds: 6.2, rc: 0}
findings:
    description: What the gate found, each with the GPU's index (null for the host), the check, fail or warn, and a sentence.
    returned: always
    type: list
    elements: dict
    sample: [{gpu: 3, check: ecc, severity: fail, message: "GPU 3: 2 uncorrectable ECC errors since the driver loaded"}]
msg:
    description: One line saying what was found (and what DCGM's diagnostic said, where it ran or is absent).
    returned: always
    type: str
    sample: "8 GPUs healthy; dcgmi diag -r 1 passed (1 tests, 6.2 s)"
"""

import traceback

try:
    from ansible.module_utils.basic import AnsibleModule, missing_required_lib
except ImportError:  # The GPU machine has no Ansible: the core is used directly there.
    AnsibleModule = None
try:
    from ansible.module_utils.hsx import dcgm, gpu_health
    from ansible.module_utils.hsx.nvml import (
        NvmlUnavailable,
        PynvmlBackend,
        driver_gpu_buses,
        driver_present,
        kernel_driver,
    )
except ImportError:  # Not run by Ansible: the same files, from the hsx package (module_utils/hsx).
    from hsx import dcgm, gpu_health
    from hsx.nvml import NvmlUnavailable, PynvmlBackend, driver_gpu_buses, driver_present, kernel_driver
try:
    import pynvml
except ImportError:
    pynvml = None
    PYNVML_IMPORT_ERROR = traceback.format_exc()
else:
    PYNVML_IMPORT_ERROR = None

# Where the driver's signs are looked for (/proc, /sys, /dev below it) and the ring buffer is read: the
# unit tests point these at a made-up node.
ROOT = "/"
KMSG = "/dev/kmsg"

ARGUMENT_SPEC = dict(
    expected_gpus=dict(type="int"),
    max_uncorrectable_ecc=dict(type="int", default=0),
    pcie_width_must_be_max=dict(type="bool", default=True),
    bad_xids=dict(type="list", elements="int"),
    require_gpus=dict(type="bool", default=False),
    xid_record_dir=dict(type="path", default="/var/lib/hsx-gpu-health"),
    journal=dict(type="bool", default=True),
    dcgm_diag=dict(type="str", choices=["auto", "required", "off"], default="auto"),
    dcgm_diag_level=dict(type="int", choices=[1, 2, 3, 4], default=1),
    dcgm_diag_timeout=dict(type="int"),
    dcgmi_path=dict(type="path"),
)


class GpuHealthModule:
    """The module: reads NVML and the XIDs, runs DCGM's diagnostic where it is, judges, and fails the
    task when the gate does not pass."""

    def __init__(self, module, nvml=None):
        self.module = module
        self.params = module.params
        self.nvml = nvml or pynvml

    def policy(self) -> gpu_health.Policy:
        p = self.params
        if p["expected_gpus"] is not None and p["expected_gpus"] < 0:
            self.module.fail_json(msg=f"expected_gpus must be >= 0, not {p['expected_gpus']}")
        if p["dcgm_diag_timeout"] is not None and p["dcgm_diag_timeout"] < 1:
            self.module.fail_json(msg=f"dcgm_diag_timeout must be >= 1 second, not {p['dcgm_diag_timeout']}")
        bad = gpu_health.BAD_XIDS if p["bad_xids"] is None else tuple(p["bad_xids"])
        return gpu_health.Policy(p["expected_gpus"], p["max_uncorrectable_ecc"], p["pcie_width_must_be_max"], bad)

    def empty(self) -> dict:
        return {"changed": False, "gpus": [], "xids": None, "xid_sources": [], "xids_ignored": 0, "findings": [],
                "dcgm": {"state": "skipped", "message": "no GPU"}}

    def no_gpu(self, reason: str) -> dict:
        if self.params["require_gpus"] or self.params["expected_gpus"]:
            self.module.fail_json(msg=f"GPU health: {reason}", passed=False, **self.empty())
        return dict(self.empty(), passed=True, msg=f"no GPU: {reason}")

    def dcgmi(self) -> str | None:
        path = self.params["dcgmi_path"]
        return path if path else self.module.get_bin_path("dcgmi")

    def diag(self, failing: bool) -> tuple[dict, gpu_health.Finding | None]:
        """RV(dcgm) and the finding it adds (None: nothing to add)."""
        p = self.params
        level = p["dcgm_diag_level"]
        if p["dcgm_diag"] == "off":
            return {"state": "off", "level": level, "message": "DCGM's diagnostic is turned off (dcgm_diag: off)"}, None
        dcgmi = self.dcgmi()
        if not dcgmi:
            msg = "dcgmi not found (DCGM is not installed): no active check ran"
            if p["dcgm_diag"] == "required":
                return {"state": "absent", "level": level, "message": msg}, gpu_health.Finding(
                    None, "dcgm", "fail", f"{msg}, and dcgm_diag is required")
            return {"state": "absent", "level": level, "message": msg}, None
        if failing:
            return {"state": "skipped", "level": level, "message": "not run: the gate already failed"}, None
        r = dcgm.run_diag(dcgmi, level, p["dcgm_diag_timeout"])
        out = {"state": r.state, "level": level, "message": r.message, "failed_tests": r.failed_tests,
               "seconds": r.seconds, "rc": r.rc}
        return out, (gpu_health.Finding(None, "dcgm", "fail", r.message) if r.state == "failed" else None)

    def run(self) -> dict:
        policy = self.policy()
        p = self.params
        driver = kernel_driver(ROOT)
        if self.nvml is None:
            if p["require_gpus"] or driver_present(ROOT):
                self.module.fail_json(msg=missing_required_lib("nvidia-ml-py"), exception=PYNVML_IMPORT_ERROR)
            return self.no_gpu("no NVIDIA driver installed (and nvidia-ml-py is not installed)")
        try:
            backend = PynvmlBackend(self.nvml)
        except NvmlUnavailable as e:
            if driver:
                self.module.fail_json(msg=f"GPU health gate failed: the NVIDIA driver is loaded ({driver}) but {e} "
                                      "(a driver/library version mismatch needs a reboot or a matching driver)",
                                      passed=False, **dict(self.empty(), dcgm={"state": "skipped", "message": str(e)}))
            return self.no_gpu(str(e))
        try:
            gpus = gpu_health.read_health(self.nvml)
        finally:
            backend.close()
        buses = {g.pci_bus_id for g in gpus} | driver_gpu_buses(ROOT)
        reading = gpu_health.read_xids(
            buses, kmsg=KMSG, journalctl=self.module.get_bin_path("journalctl") if p["journal"] else None,
            record_dir=p["xid_record_dir"] or None, write=not self.module.check_mode)
        findings = gpu_health.judge(gpus, reading.xids, policy) + reading.notes
        dcgm_result, finding = self.diag(not gpu_health.passed(findings))
        findings += [finding] if finding else []
        result = dict(gpu_health.report(gpus, reading.xids, findings), changed=reading.recorded,
                      xid_sources=reading.sources, xids_ignored=reading.ignored, dcgm=dcgm_result)
        failing = [f.message for f in findings if f.severity == "fail"]
        if failing:
            self.module.fail_json(msg="GPU health gate failed: " + "; ".join(failing), **result)
        warnings = [f.message for f in findings if f.severity == "warn"]
        active = f"; {dcgm_result['message']}" if dcgm_result["state"] in ("passed", "absent") else ""
        result["msg"] = f"{len(gpus)} GPUs healthy{active}" + (f" ({'; '.join(warnings)})" if warnings else "")
        return result


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    module.exit_json(**GpuHealthModule(module).run())


if __name__ == "__main__":
    main()
