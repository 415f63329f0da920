# Copyright: (c) 2026, hsx maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The NVML interface of the gpu_processes module: what the GPUs hold, as plain data.

Contract:

- `PynvmlBackend(nvml)` is the only code that talks to NVML. `nvml` is the `pynvml` module
  (nvidia-ml-py) or a stand-in with its interface; this module never imports pynvml itself (the
  core is stdlib-only, tests/unit/test_portable_core.py), the caller passes it in. Construction
  calls nvmlInit() and raises NvmlUnavailable when NVML cannot start; `gpus()` returns one `Gpu`
  per device with its compute processes (`GpuProc`); `close()` shuts NVML down and never raises.
- Anything with `gpus() -> list[Gpu]` and `close()` can stand in for the backend (the unit tests
  use a fake).
- `devices()` and `gpu_result()` turn a reading into the module's RV(devices) and its result keys
  (MiB = MIB bytes, rounded down); `driver_present()` tells "no driver" from "nvidia-ml-py missing".
- `kernel_driver()` names the sign that the NVIDIA kernel driver is loaded (its /proc or /sys entry, a
  /dev/nvidiaN node) or None, and `driver_gpu_buses()` the PCI addresses of the GPUs it drives; both
  take the root to look under (tests fake a node's /proc, /sys and /dev below a temp directory).
"""

from __future__ import annotations

import ctypes.util
import os
import re
from dataclasses import dataclass, field
from typing import Any

MIB = 1 << 20


class NvmlUnavailable(Exception):
    """NVML cannot start here (no driver, no libnvidia-ml, driver/library mismatch)."""


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


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class PynvmlBackend:
    """The only code that talks to NVML: `gpus()` returns plain data (tests use a fake instead)."""

    def __init__(self, nvml: Any):
        self.nvml = nvml
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


_PCI_ADDRESS = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def kernel_driver(root: str = "/") -> str | None:
    """Where the NVIDIA kernel driver shows it is loaded under `root` (/proc/driver/nvidia,
    /sys/module/nvidia, or a /dev/nvidiaN device node), or None: then NVML failing to start means
    "no GPU here", not a broken driver. Only looks (stat, listdir); opens nothing."""
    for rel in ("proc/driver/nvidia", "sys/module/nvidia"):
        if os.path.isdir(os.path.join(root, rel)):
            return "/" + rel
    try:
        names = os.listdir(os.path.join(root, "dev"))
    except OSError:
        return None
    nodes = sorted(n for n in names if re.fullmatch(r"nvidia[0-9]+", n))
    return f"/dev/{nodes[0]}" if nodes else None


def driver_gpu_buses(root: str = "/") -> set[str]:
    """The PCI addresses (``0000:18:00.0``, lower case) of the GPUs the NVIDIA driver has bound,
    from /proc/driver/nvidia/gpus/ and /sys/bus/pci/drivers/nvidia/: those stay listed when NVML no
    longer lists a GPU (one that fell off the bus). Names that are not PCI addresses are skipped."""
    found: set[str] = set()
    for rel in ("proc/driver/nvidia/gpus", "sys/bus/pci/drivers/nvidia"):
        try:
            names = os.listdir(os.path.join(root, rel))
        except OSError:
            continue
        found.update(n.lower() for n in names if _PCI_ADDRESS.fullmatch(n.lower()))
    return found


def driver_present(root: str = "/") -> bool:
    """An NVIDIA driver is installed here (so a missing nvidia-ml-py is an error, not 'no GPU'):
    its kernel module is loaded, or libnvidia-ml is installed."""
    return kernel_driver(root) is not None or bool(ctypes.util.find_library("nvidia-ml"))


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
