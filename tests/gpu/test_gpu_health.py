"""The GPU health gate against real NVML on a real NVIDIA GPU (never in CI).

Run on the GPU machine (nvidia-ml-py; Ansible is not needed):

    python3 tests/gpu/test_gpu_health.py          # prints the readings and the verdict, exit 0 = passed
    python3 -m pytest tests/gpu -q -s              # the same as a test (skipped without a GPU)

What it checks on a healthy GPU: every GPU is read (name, UUID, PCI address); the readings a data
centre GPU must report are known (ECC mode, the volatile uncorrectable count, the PCIe width and its
maximum); the NVIDIA kernel driver is seen where it is loaded (hsx.nvml.kernel_driver) and lists the
same GPUs as NVML (driver_gpu_buses); the kernel log is read where the machine lets root read it, the
driver's own records in it have the kernel's facility (0); and the gate's verdict (hsx.gpu_health.judge
with the default policy) is a pass. No XID record is written (record_dir None). The readings go to
stdout as JSON, for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "module_utils"))
from hsx import gpu_health, xidlog  # noqa: E402
from hsx.nvml import NvmlUnavailable, PynvmlBackend, driver_gpu_buses, kernel_driver  # noqa: E402


def reading() -> dict:
    import pynvml

    backend = PynvmlBackend(pynvml)
    try:
        gpus = gpu_health.read_health(pynvml)
        driver = pynvml.nvmlSystemGetDriverVersion()
    finally:
        backend.close()
    buses = {g.pci_bus_id for g in gpus} | driver_gpu_buses()
    reading = gpu_health.read_xids(buses, journalctl=shutil.which("journalctl"), record_dir=None)
    findings = gpu_health.judge(gpus, reading.xids, gpu_health.Policy(expected_gpus=len(gpus))) + reading.notes
    out = gpu_health.report(gpus, reading.xids, findings)
    out["driver"] = driver if isinstance(driver, str) else driver.decode()
    out["kernel_driver"] = kernel_driver()
    out["driver_gpu_buses"] = sorted(driver_gpu_buses())
    out["xid_sources"] = reading.sources
    records = xidlog.kernel_records()
    out["kernel_log_records"] = None if records is None else len(records)
    out["nvrm_record_facilities"] = None if records is None else sorted(
        {r.facility for r in records if r.text.startswith("NVRM: ")})
    return out


def test_healthy_gpu_passes_the_gate():
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pytest.skip("no NVIDIA GPU here")
    pynvml.nvmlShutdown()
    out = reading()
    print(json.dumps(out, indent=1))
    assert out["gpus"], "NVML listed no GPU"
    for g in out["gpus"]:
        assert g["uuid"].startswith("GPU-") and g["pci_bus_id"].count(":") == 2, g
        assert g["ecc_enabled"] is not None, f"ECC mode not reported: {g}"
        if g["ecc_enabled"]:
            assert g["ecc_uncorrectable_volatile"] is not None, g
        assert g["pcie_width"] and g["pcie_width_max"], f"PCIe width not reported: {g}"
    assert out["kernel_driver"] is not None, "NVML works but no sign of the NVIDIA kernel driver was found"
    assert {xidlog.bus(b) for b in out["driver_gpu_buses"]} == {g["pci_bus_id"] for g in out["gpus"]}, out
    if out["kernel_log_records"] is not None:
        assert out["nvrm_record_facilities"] in ([], [0]), out["nvrm_record_facilities"]
    assert out["passed"], out["findings"]


if __name__ == "__main__":
    try:
        test_healthy_gpu_passes_the_gate()
    except NvmlUnavailable as e:
        sys.exit(f"no NVML: {e}")
