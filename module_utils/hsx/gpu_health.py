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
- `read_xids(lines)` finds the NVIDIA driver's XID reports (``NVRM: Xid (PCI:0000:18:00): 79, ...``)
  in kernel log lines; `kernel_log()` gives those lines since boot from /dev/kmsg (read without
  blocking) or None where it cannot be read (not root, a container).
- `judge(gpus, xids, policy)` is pure: it returns findings (`Finding`: gpu index or None, check name,
  "fail" or "warn", a sentence), and `passed(findings)` is True when none is "fail". What counts
  as failing follows DCGM's health watches (memory: uncorrectable ECC since boot and a pending or
  failed row remap / page retirement; PCIe: a link narrower than the GPU's; the XIDs that mean a bad
  GPU), with the thresholds in `Policy` so a site can change them.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

# The XIDs that mean the GPU itself is bad or needs a reset before it can be trusted (NVIDIA's XID
# catalogue): 48 double-bit ECC, 61/62 internal micro-controller halt, 63/64 row remap recorded /
# failed, 74 NVLink error, 79 fallen off the bus, 92 high single-bit ECC rate, 94/95 contained /
# uncontained ECC, 119/120 GSP RPC timeout / error, 140 unrecovered ECC. Application faults
# (13, 31, 43, 45: a bad kernel, an MMU fault of one program, a killed context) are not listed.
BAD_XIDS = (48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140)

_XID = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+)")


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


@dataclass
class Xid:
    pci_bus_id: str
    xid: int
    line: str = field(repr=False)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bus(value: str) -> str:
    """A PCI address in one form: domain 0000, lower case (NVML says 00000000:18:00.0, XIDs 0000:18:00)."""
    parts = value.lower().split(":")
    if len(parts) == 3:
        parts[0] = parts[0][-4:].rjust(4, "0")
    return ":".join(parts).split(".", maxsplit=1)[0]


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
                      _bus(_text(n.nvmlDeviceGetPciInfo(h).busId)))
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


def kernel_log(path: str = "/dev/kmsg", max_records: int = 200_000) -> list[str] | None:
    """The kernel log's records since boot (as far as the ring buffer holds them), read from `path`
    without blocking and without following a link; None where it cannot be opened (not root, a
    container without /dev/kmsg). /dev/kmsg returns one record a read, EAGAIN at the end and EPIPE
    for a record overwritten while reading (skipped)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    lines: list[str] = []
    try:
        while len(lines) < max_records:
            try:
                record = os.read(fd, 8192)
            except OSError as e:
                if e.errno == errno.EPIPE:
                    continue
                break  # EAGAIN: the end; anything else: stop with what was read
            if not record:
                break
            lines.append(record.decode("utf-8", "replace").split(";", 1)[-1].rstrip("\n"))
    finally:
        os.close(fd)
    return lines


def read_xids(lines: list[str]) -> list[Xid]:
    """The NVIDIA driver's XID reports among kernel log lines."""
    found = []
    for line in lines:
        m = _XID.search(line)
        if m:
            found.append(Xid(_bus(m.group(1)), int(m.group(2)), line.strip()))
    return found


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
    for x in xids:
        if x.xid in policy.bad_xids:
            gpu = by_bus.get(x.pci_bus_id)
            fail(gpu, "xid", f"GPU {gpu if gpu is not None else x.pci_bus_id}: XID {x.xid} since boot: {x.line}")
    return findings


def passed(findings: list[Finding]) -> bool:
    return not any(f.severity == "fail" for f in findings)


def report(gpus: list[GpuHealth], xids: list[Xid] | None, findings: list[Finding]) -> dict:
    """Readings and verdict as plain data (the module's result, the report's section)."""
    return {
        "passed": passed(findings),
        "gpus": [asdict(g) for g in gpus],
        "xids": None if xids is None else [{"pci_bus_id": x.pci_bus_id, "xid": x.xid, "line": x.line} for x in xids],
        "findings": [asdict(f) for f in findings],
    }
