"""The GPU health gate (module_utils/hsx/gpu_health.py) against a recorded NVML.

FakeNvml answers as nvidia-ml-py does on a Hopper GPU (no page retirement: NotSupported), with the
readings a test sets; the kernel log is records as /dev/kmsg gives them (header, then text). The
XID sources and their forgeries: test_gpu_health_xid.py; DCGM's diagnostic: test_gpu_health_dcgm.py.
"""

from __future__ import annotations

import json
import os

import pytest
from ansible.module_utils.testing import patch_module_args
from ansible_modules import load_module

from hsx import gpu_health as gh
from hsx import xidlog

module = load_module("gpu_health")


class NVMLError(Exception):
    pass


class FakeNvml:
    """pynvml's interface, as far as read_health uses it. `gpus`: one dict of readings a GPU."""

    NVMLError = NVMLError
    NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
    NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC = 0, 1
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, gpus: list[dict]):
        self.gpus = gpus

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200"

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h['bus']}"

    def nvmlDeviceGetPciInfo(self, h):
        return type("Pci", (), {"busId": f"00000000:{h['bus']}:00.0".encode()})

    def nvmlDeviceGetEccMode(self, h):
        return (h.get("ecc", 1), h.get("ecc", 1))

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        return h.get(("ecc", kind, counter), 0)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        raise NVMLError("Not Supported")

    def nvmlDeviceGetRemappedRows(self, h):
        return h.get("rows", (0, 0, 0, 0))

    def _get(self, key, default):
        return lambda h: h.get(key, default)

    def __getattr__(self, name):
        links = {"nvmlDeviceGetCurrPcieLinkGeneration": ("gen", 5), "nvmlDeviceGetMaxPcieLinkGeneration": ("gen_max", 5),
                 "nvmlDeviceGetGpuMaxPcieLinkGeneration": ("gen_gpu_max", 5),
                 "nvmlDeviceGetCurrPcieLinkWidth": ("width", 16), "nvmlDeviceGetMaxPcieLinkWidth": ("width_max", 16),
                 "nvmlDeviceGetPcieReplayCounter": ("replay", 0), "nvmlDeviceGetTemperature": ("temp", 30)}
        if name in links:
            key, default = links[name]
            return lambda h, *a: h.get(key, default)
        raise AttributeError(name)


def verdict(gpus: list[dict], log: list[str] | None = (), **policy) -> tuple[bool, list[gh.Finding]]:
    readings = gh.read_health(FakeNvml(gpus))
    records = xidlog.parse_kmsg("\n".join(log or ()).encode())
    xids = None if log is None else xidlog.match_xids(records, {g.pci_bus_id for g in readings}).xids
    findings = gh.judge(readings, xids, gh.Policy(**policy))
    return gh.passed(findings), findings


def checks(findings, severity="fail") -> list[tuple]:
    return [(f.gpu, f.check) for f in findings if f.severity == severity]


HEALTHY = [{"bus": "18"}, {"bus": "2a"}]


def test_healthy_gpus_pass_and_hopper_page_retirement_is_not_known_not_guessed():
    ok, findings = verdict(HEALTHY, expected_gpus=2)
    assert ok and findings == []
    g = gh.read_health(FakeNvml(HEALTHY))[1]
    assert g.pci_bus_id == "0000:2a:00" and g.retired_pages_pending is None and g.pcie_width == 16


def test_a_missing_gpu_fails():
    ok, findings = verdict(HEALTHY[:1], expected_gpus=2)
    assert not ok and checks(findings) == [(None, "count")]
    assert "1 GPUs present, 2 expected" in findings[0].message


def test_no_gpu_at_all_fails_even_without_an_expected_count():
    assert checks(verdict([])[1]) == [(None, "count")]


def test_uncorrectable_ecc_since_boot_fails_that_gpu():
    bad = {"bus": "2a", ("ecc", 1, 0): 2}
    ok, findings = verdict([HEALTHY[0], bad])
    assert not ok and checks(findings) == [(1, "ecc")]
    assert "2 uncorrectable ECC errors" in findings[0].message
    # a site that tolerates some
    assert verdict([HEALTHY[0], bad], max_uncorrectable_ecc=2)[0]


def test_correctable_ecc_alone_passes():
    assert verdict([{"bus": "18", ("ecc", 0, 0): 40}])[0]


def test_row_remap_pending_or_failed_fails():
    assert checks(verdict([{"bus": "18", "rows": (1, 1, 1, 0)}])[1]) == [(0, "row_remap")]
    ok, findings = verdict([{"bus": "18", "rows": (0, 3, 0, 1)}])
    assert not ok and "failed" in findings[0].message


def test_a_narrow_pcie_link_fails_and_an_idle_link_generation_does_not():
    # An idle GPU drops its link generation to save power: the current generation is no finding.
    assert verdict([{"bus": "18", "gen": 1}])[0]
    ok, findings = verdict([{"bus": "18", "width": 8}])
    assert not ok and "x8, the GPU's maximum is x16" in findings[0].message
    assert verdict([{"bus": "18", "width": 8}], pcie_width_must_be_max=False)[0]
    ok, findings = verdict([{"bus": "18", "gen_max": 4}])
    assert ok and checks(findings, "warn") == [(0, "pcie")]


def test_ecc_disabled_is_a_warning():
    ok, findings = verdict([{"bus": "18", "ecc": 0}])
    assert ok and checks(findings, "warn") == [(0, "ecc")]


# As /dev/kmsg gives them (facility 0, level 3/4: the kernel's; the first as recorded on the lent H100).
LOG = [
    "3,354,461185,-;NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (nixbld@)",
    "4,900,7001234,c;NVRM: Xid (PCI:0000:2a:00): 13, pid=4242, name=python3, Graphics Exception: ESR 0x404600",
    "4,901,7002345,c;NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
]


def test_a_bad_xid_fails_its_gpu_and_an_application_fault_does_not():
    ok, findings = verdict(HEALTHY, LOG)
    assert not ok and checks(findings) == [(0, "xid")]
    assert "XID 79" in findings[0].message and "fallen off the bus" in findings[0].message
    assert verdict(HEALTHY, LOG[:2])[0]


def test_an_unreadable_kernel_log_is_a_warning_not_a_pass_of_the_xid_check():
    ok, findings = verdict(HEALTHY, None)
    assert ok and checks(findings, "warn") == [(None, "xid")]


def test_kernel_records_read_without_blocking_and_follow_no_link(tmp_path):
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    assert xidlog.kernel_records(str(fifo)) == []  # non-blocking: an empty FIFO is the end, not a hang
    target = tmp_path / "t"
    target.write_text("6,1,2,-;NVRM: Xid (PCI:0000:18:00): 48, DBE\n SUBSYSTEM=pci\n DEVICE=+pci:0000:18:00.0\n")
    link = tmp_path / "link"
    link.symlink_to(target)
    assert xidlog.kernel_records(str(link)) is None
    records = xidlog.kernel_records(str(target))
    assert records == [xidlog.Record(0, 6, 1, "NVRM: Xid (PCI:0000:18:00): 48, DBE")]  # dictionary lines skipped
    assert xidlog.match_xids(records, {"0000:18:00.0"}).xids[0].xid == 48


def test_report_is_plain_data():
    readings = gh.read_health(FakeNvml(HEALTHY))
    out = gh.report(readings, [], gh.judge(readings, [], gh.Policy()))
    assert out["passed"] is True and out["gpus"][0]["pci_bus_id"] == "0000:18:00" and out["xids"] == []


@pytest.mark.parametrize("bus", ["00000000:18:00.0", "0000:18:00", "00000000:18:00"])
def test_bus_ids_of_nvml_and_the_kernel_log_compare(bus):
    assert xidlog.bus(bus) == "0000:18:00"


# ---------------------------------------------------------------- the Ansible module
def node(tmp_path, monkeypatch, log=(), driver: bool = False) -> None:
    """The module's view of a made-up node: its ring buffer (None: unreadable) and its /proc, /sys
    and /dev (with a /dev/nvidia0 node, the NVIDIA driver's sign, when `driver`)."""
    kmsg = tmp_path / "kmsg"
    if log is not None:
        kmsg.write_text("".join(line + "\n" for line in log))
    root = tmp_path / "root"
    (root / "dev").mkdir(parents=True, exist_ok=True)
    if driver:
        (root / "dev" / "nvidia0").write_text("")
    monkeypatch.setattr(module, "KMSG", str(kmsg if log is not None else tmp_path / "unreadable"))
    monkeypatch.setattr(module, "ROOT", str(root))


def run_module(capsys, monkeypatch, tmp_path, gpus, log=(), nvml=None, driver=False, **args) -> dict:
    """One run of the module on a made-up node (no journal, no XID record, no DCGM unless asked)."""
    fake = nvml or FakeNvml(gpus)
    if nvml is None:
        fake.nvmlInit = fake.nvmlShutdown = lambda: None
    monkeypatch.setattr(module, "pynvml", fake)
    node(tmp_path, monkeypatch, log, driver)
    args = {"journal": False, "xid_record_dir": "", "dcgm_diag": "off", **args}
    with patch_module_args(args), pytest.raises(SystemExit):
        module.main()
    return json.loads(capsys.readouterr().out)


def test_module_passes_healthy_gpus_in_check_mode_too(capsys, monkeypatch, tmp_path):
    for check in (False, True):
        out = run_module(capsys, monkeypatch, tmp_path, HEALTHY, expected_gpus=2, _ansible_check_mode=check)
        assert out["passed"] and not out.get("failed") and out["changed"] is False
        assert out["msg"] == "2 GPUs healthy" and len(out["gpus"]) == 2 and out["xids"] == []
        assert out["xid_sources"] == ["kmsg"] and out["dcgm"]["state"] == "off"


def test_module_fails_the_host_with_every_finding(capsys, monkeypatch, tmp_path):
    bad = {"bus": "2a", ("ecc", 1, 0): 1}
    out = run_module(capsys, monkeypatch, tmp_path, [HEALTHY[0], bad], LOG, expected_gpus=3)
    assert out["failed"] and out["passed"] is False
    fails = [(f["gpu"], f["check"]) for f in out["findings"] if f["severity"] == "fail"]
    assert fails == [(None, "count"), (1, "ecc"), (0, "xid")]
    assert out["msg"].startswith("GPU health gate failed: 2 GPUs present, 3 expected; GPU 1: 1 uncorrectable")


def test_module_settings_change_the_verdict(capsys, monkeypatch, tmp_path):
    out = run_module(capsys, monkeypatch, tmp_path, HEALTHY, LOG, bad_xids=[48])
    assert out["passed"] and out["xids"][0]["xid"] == 13
    out = run_module(capsys, monkeypatch, tmp_path, HEALTHY, None)
    assert out["passed"] and "XIDs not checked" in out["msg"] and out["xid_sources"] == []


class Unstartable(FakeNvml):
    """nvmlInit fails as pynvml's does: NVMLError_DriverNotLoaded, NVMLError_LibRmVersionMismatch."""

    def __init__(self, error: str):
        super().__init__([])
        self.error = error

    def nvmlInit(self):
        raise NVMLError(self.error)


def test_module_without_nvml_passes_a_cpu_host_unless_gpus_are_required(capsys, monkeypatch, tmp_path):
    out = run_module(capsys, monkeypatch, tmp_path, [], nvml=Unstartable("Driver Not Loaded"))
    assert out["passed"] and out["gpus"] == [] and "NVML could not start" in out["msg"]
    assert out["dcgm"]["state"] == "skipped"
    out = run_module(capsys, monkeypatch, tmp_path, [], nvml=Unstartable("Driver Not Loaded"), expected_gpus=8)
    assert out["failed"] and out["msg"].startswith("GPU health: NVML could not start")


@pytest.mark.parametrize("sign", ["proc/driver/nvidia", "sys/module/nvidia", "dev/nvidia3"])
def test_nvml_failing_where_the_driver_is_loaded_fails_with_nvml_error(capsys, monkeypatch, tmp_path, sign):
    """Issue #51: a GPU node whose NVML cannot start (driver/library version mismatch) passed as
    'no GPU'. Where the kernel driver shows (its /proc or /sys entry, a /dev/nvidiaN node) it fails."""
    mismatch = Unstartable("RM has detected an NVML/RM version mismatch.")
    root = tmp_path / "root"
    (root / sign).parent.mkdir(parents=True, exist_ok=True)
    (root / sign).mkdir() if not sign.startswith("dev/") else (root / sign).write_text("")
    out = run_module(capsys, monkeypatch, tmp_path, [], nvml=mismatch)
    assert out["failed"] and out["passed"] is False
    assert f"the NVIDIA driver is loaded (/{sign})" in out["msg"] and "NVRM version mismatch" not in out["msg"]
    assert "RM has detected an NVML/RM version mismatch" in out["msg"]
    # /dev/nvidiactl alone, or nvidia-uvm, is no GPU device node: that node passes as a CPU host
    (root / sign).rmdir() if not sign.startswith("dev/") else (root / sign).unlink()
    (root / "dev" / "nvidiactl").write_text("")
    out = run_module(capsys, monkeypatch, tmp_path, [], nvml=mismatch)
    assert out["passed"] and not out.get("failed") and out["msg"].startswith("no GPU: NVML could not start")
