# Copyright: (c) 2026, hsx maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The GPU health gate: is every GPU of this node fit to resume a long extraction on?

Contract:

- `read_health(nvml)` reads each GPU through NVML (`nvml` is the `pynvml` module of nvidia-ml-py or
  a stand-in with its interface; the core never imports it, as `hsx.nvml`) and returns one
  `GpuHealth` per device. A reading NVML does not support on this GPU or driver is None ("not
  known"), never a guess: Hopper has no page retirement (row remapping replaced it), a VM may hide
  the PCIe link.
- `read_xids(buses, ...)` gathers the NVIDIA driver's XID reports for the node's GPUs (`buses`: their
  PCI addresses, from NVML and the driver) from every source it can read: the kernel ring buffer
  (/dev/kmsg), journald's kernel records of this boot, and the gate's own record of the XIDs it saw
  earlier in this boot, which it then updates (hsx.xidlog: only the driver's own records count, and
  an XID once seen survives a flood that pushes it out of the ring buffer). It returns an
  `XidReading`: the XIDs (None when no source could be read), the sources read, and notes (warnings,
  or a failure for a record that is not the gate's).
- `judge(gpus, xids, policy)` is pure: it returns findings (`Finding`: gpu index or None, check name,
  "fail" or "warn", a sentence), and `passed(findings)` is True when none is "fail". What counts
  as failing follows DCGM's health watches (memory: uncorrectable ECC since boot and a pending or
  failed row remap / page retirement; PCIe: a link narrower than the GPU's; the XIDs that mean a bad
  GPU), with the thresholds in `Policy` so a site can change them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from .xidlog import (
    Xid,
    XidRecordError,
    boot_id,
    bus,
    journal_records,
    kernel_records,
    load_seen,
    match_xids,
    save_seen,
    unique,
)

# The XIDs that mean the GPU itself is bad or needs a reset before it can be trusted (NVIDIA's XID
# catalogue): 48 double-bit ECC, 61/62 internal micro-controller halt, 63/64 row remap recorded /
# failed, 74 NVLink error, 79 fallen off the bus, 92 high single-bit ECC rate, 94/95 contained /
# uncontained ECC, 119/120 GSP RPC timeout / error, 140 unrecovered ECC. Application faults
# (13, 31, 43, 45: a bad kernel, an MMU fault of one program, a killed context) are not listed.
BAD_XIDS = (48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140)


@dataclass
class Policy:
    """What fails the gate. None for expected_gpus: any number but zero."""

    expected_gpus: int | None = None
    max_uncorrectable_ecc: int = 0
    pcie_width_must_be_max: bool = True
    bad_xids: tuple[int, ...] = BAD_XIDS


@dataclass
class GpuHealth:
    """One GPU's health readings (None: not supported or not reported here)."""

    index: int
    name: str
    uuid: str
    pci_bus_id: str
    ecc_enabled: bool | None = None
    ecc_uncorrectable_volatile: int | None = None
    ecc_correctable_volatile: int | None = None
    ecc_uncorrectable_aggregate: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_correctable: int | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_gen_gpu_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    pcie_replay_counter: int | None = None
    temperature_c: int | None = None


@dataclass
class Finding:
    gpu: int | None
    check: str
    severity: str  # "fail" or "warn"
    message: str


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _maybe(nvml: Any, fn: Callable[[], Any]) -> Any:
    """fn()'s value, or None where NVML says the reading is not supported or not permitted here."""
    try:
        return fn()
    except nvml.NVMLError:
        return None


def read_health(nvml: Any) -> list[GpuHealth]:
    """Every GPU's readings. nvmlInit must have been called (hsx.nvml.PynvmlBackend does)."""
    n = nvml
    out = []
    for index in range(n.nvmlDeviceGetCount()):
        h = n.nvmlDeviceGetHandleByIndex(index)
        g = GpuHealth(index, _text(n.nvmlDeviceGetName(h)), _text(n.nvmlDeviceGetUUID(h)),
                      bus(_text(n.nvmlDeviceGetPciInfo(h).busId)))
        mode = _maybe(n, lambda h=h: n.nvmlDeviceGetEccMode(h))
        g.ecc_enabled = None if mode is None else bool(mode[0])
        if g.ecc_enabled:
            def ecc(kind: int, counter: int, h: Any = h) -> int | None:
                value = _maybe(n, lambda: n.nvmlDeviceGetTotalEccErrors(h, kind, counter))
                return None if value is None else int(value)
            g.ecc_uncorrectable_volatile = ecc(n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC)
            g.ecc_correctable_volatile = ecc(n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC)
            g.ecc_uncorrectable_aggregate = ecc(n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_AGGREGATE_ECC)
        pending = _maybe(n, lambda h=h: n.nvmlDeviceGetRetiredPagesPendingStatus(h))
        g.retired_pages_pending = None if pending is None else bool(pending)
        rows = _maybe(n, lambda h=h: n.nvmlDeviceGetRemappedRows(h))
        if rows is not None:
            corr, unc, is_pending, failed = rows
            g.remapped_rows_correctable, g.remapped_rows_uncorrectable = int(corr), int(unc)
            g.remap_pending, g.remap_failed = bool(is_pending), bool(failed)
        for attr, fn in (("pcie_gen", "nvmlDeviceGetCurrPcieLinkGeneration"),
                         ("pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration"),
                         ("pcie_gen_gpu_max", "nvmlDeviceGetGpuMaxPcieLinkGeneration"),
                         ("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth"),
                         ("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth"),
                         ("pcie_replay_counter", "nvmlDeviceGetPcieReplayCounter")):
            value = _maybe(n, lambda h=h, fn=fn: getattr(n, fn)(h)) if hasattr(n, fn) else None
            setattr(g, attr, None if value is None else int(value))
        temp = _maybe(n, lambda h=h: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))
        g.temperature_c = None if temp is None else int(temp)
        out.append(g)
    return out


@dataclass
class XidReading:
    """What read_xids found. xids None: no source could be read (the check is a warning then)."""

    xids: list[Xid] | None
    sources: list[str] = field(default_factory=list)
    ignored: int = 0
    recorded: bool = False
    notes: list[Finding] = field(default_factory=list)


def read_xids(buses: set[str], *, kmsg: str = "/dev/kmsg", journalctl: str | None = None,
              record_dir: str | None = None, boot: str | None = None, write: bool = True) -> XidReading:
    """The driver's XIDs for the GPUs at `buses` since this boot, from the ring buffer at `kmsg`,
    the journal (`journalctl`: its path, None not to read it) and the record in `record_dir` (None:
    no record), which is updated with what was found when `write` (check mode: not). `boot` is this
    boot's id (default: the kernel's); without one no record is read or kept."""
    r = XidReading(None)
    ring = kernel_records(kmsg)
    journal = journal_records(journalctl)
    found = []
    for name, records in (("kmsg", ring), ("journal", journal)):
        if records is not None:
            scan = match_xids(records, buses)
            r.sources.append(name)
            r.ignored += scan.ignored
            found += scan.xids
    if r.ignored:
        r.notes.append(Finding(None, "xid", "warn", f"{r.ignored} kernel log records mention an XID but are not "
                               "the NVIDIA driver's own report for a GPU of this node (not the kernel's facility, "
                               "not at the start of the message, or another PCI address): ignored"))
    if ring and ring[0].seq > 0 and journal is None:
        r.notes.append(Finding(None, "xid", "warn", f"the kernel ring buffer no longer holds its first {ring[0].seq} "
                               "records of this boot and no journal was read: an XID among them counts only if "
                               "an earlier run of the gate recorded it"))
    seen: list[Xid] = []
    boot = boot if boot is not None else boot_id()
    if record_dir and boot is None:
        r.notes.append(Finding(None, "xid", "warn", "no boot id (/proc/sys/kernel/random/boot_id): XIDs not recorded"))
    elif record_dir and boot:
        try:
            seen = load_seen(record_dir, boot)
        except XidRecordError as e:
            r.notes.append(Finding(None, "xid_record", "fail", f"the XID record cannot be trusted: {e}; XIDs seen "
                                   "earlier in this boot may be hidden: check it, then move it away"))
            record_dir = None
        except OSError as e:
            r.notes.append(Finding(None, "xid", "warn", f"the XID record in {record_dir} cannot be read: {e}"))
            record_dir = None
        if seen:
            r.sources.append("record")
    keys = {(x.pci_bus_id, x.xid) for x in seen}
    new = [x for x in found if (x.pci_bus_id, x.xid) not in keys]
    if record_dir and boot and write and new:
        try:
            save_seen(record_dir, boot, seen + new)
            r.recorded = True
        except (OSError, XidRecordError) as e:
            r.notes.append(Finding(None, "xid", "warn", f"the XIDs seen could not be recorded in {record_dir}: {e}"))
    if r.sources:
        r.xids = seen + found
    return r


def judge(gpus: list[GpuHealth], xids: list[Xid] | None, policy: Policy) -> list[Finding]:
    """The findings for these readings. xids None: the kernel log could not be read (a warning)."""
    findings: list[Finding] = []

    def fail(gpu: int | None, check: str, msg: str) -> None:
        findings.append(Finding(gpu, check, "fail", msg))

    def warn(gpu: int | None, check: str, msg: str) -> None:
        findings.append(Finding(gpu, check, "warn", msg))

    if policy.expected_gpus is not None and len(gpus) != policy.expected_gpus:
        fail(None, "count", f"{len(gpus)} GPUs present, {policy.expected_gpus} expected")
    elif not gpus:
        fail(None, "count", "no GPU present")
    for g in gpus:
        i = g.index
        if g.ecc_enabled is False:
            warn(i, "ecc", f"GPU {i}: ECC is disabled, memory errors go unseen")
        if (g.ecc_uncorrectable_volatile or 0) > policy.max_uncorrectable_ecc:
            fail(i, "ecc", f"GPU {i}: {g.ecc_uncorrectable_volatile} uncorrectable ECC errors since the driver loaded")
        if g.retired_pages_pending:
            fail(i, "retired_pages", f"GPU {i}: a page retirement is pending (reset the GPU to apply it)")
        if g.remap_failed:
            fail(i, "row_remap", f"GPU {i}: a row remap failed (the GPU needs service)")
        elif g.remap_pending:
            fail(i, "row_remap", f"GPU {i}: a row remap is pending (reset the GPU to apply it)")
        if (policy.pcie_width_must_be_max and g.pcie_width is not None and g.pcie_width_max
                and g.pcie_width < g.pcie_width_max):
            fail(i, "pcie", f"GPU {i}: PCIe link x{g.pcie_width}, the GPU's maximum is x{g.pcie_width_max}")
        if g.pcie_gen_max is not None and g.pcie_gen_gpu_max and g.pcie_gen_max < g.pcie_gen_gpu_max:
            warn(i, "pcie", f"GPU {i}: the link can train to PCIe gen {g.pcie_gen_max} only, the GPU supports "
                            f"gen {g.pcie_gen_gpu_max} (a slower slot or riser)")
    if xids is None:
        warn(None, "xid", "the kernel log could not be read: XIDs not checked")
        return findings
    by_bus = {g.pci_bus_id: g.index for g in gpus}
    for x in unique(xids):
        if x.xid in policy.bad_xids:
            gpu = by_bus.get(x.pci_bus_id)
            fail(gpu, "xid", f"GPU {gpu if gpu is not None else x.pci_bus_id}: XID {x.xid} since boot: {x.line}")
    return findings


def passed(findings: list[Finding]) -> bool:
    return not any(f.severity == "fail" for f in findings)


def report(gpus: list[GpuHealth], xids: list[Xid] | None, findings: list[Finding]) -> dict:
    """Readings and verdict as plain data (the module's result, the report's section); each XID once
    per GPU and number."""
    return {
        "passed": passed(findings),
        "gpus": [asdict(g) for g in gpus],
        "xids": None if xids is None else [asdict(x) for x in unique(xids)],
        "findings": [asdict(f) for f in findings],
    }
