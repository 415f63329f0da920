"""TEST-ONLY stand-in for nvidia-ml-py's `pynvml`, NOT NVML: it answers the calls the gpu_health module
makes with readings recorded on a real H100 (docs/benchmarks.md, the GPU health gate's row), or with
the readings of the JSON file named by HSX_FAKE_NVML (a list of GPUs, each a dict of overrides:
"ecc_uncorrected", "remap" [corr, unc, pending, failed], "width", ...). It stands in where no GPU is
(the dev machine, CI, the lab): put its folder first on the module's PYTHONPATH."""

from __future__ import annotations

import json
import os

NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC = 0, 1
NVML_TEMPERATURE_GPU = 0

RECORDED = {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-22369aa4-0475-584f-9f47-27b7248890e3",
            "bus": "00000000:00:06.0", "ecc": 1, "ecc_uncorrected": 0, "ecc_corrected": 0, "remap": [0, 0, 0, 0],
            "gen": 5, "gen_max": 5, "gen_gpu_max": 5, "width": 16, "width_max": 16, "replay": 0, "temp": 33}


class NVMLError(Exception):
    pass


def _gpus() -> list[dict]:
    path = os.environ.get("HSX_FAKE_NVML")
    overrides = json.load(open(path)) if path else [{}]
    return [dict(RECORDED, **o) for o in overrides]


def nvmlInit():
    if os.environ.get("HSX_FAKE_NVML_NO_DRIVER"):
        raise NVMLError("Driver Not Loaded")


def nvmlShutdown():
    pass


def nvmlSystemGetDriverVersion():
    return "580.159.04"


def nvmlDeviceGetCount():
    return len(_gpus())


def nvmlDeviceGetHandleByIndex(i):
    return _gpus()[i]


def nvmlDeviceGetName(h):
    return h["name"]


def nvmlDeviceGetUUID(h):
    return h["uuid"]


def nvmlDeviceGetPciInfo(h):
    return type("PciInfo", (), {"busId": h["bus"].encode()})


def nvmlDeviceGetEccMode(h):
    return (h["ecc"], h["ecc"])


def nvmlDeviceGetTotalEccErrors(h, kind, counter):
    return h["ecc_uncorrected"] if kind == NVML_MEMORY_ERROR_TYPE_UNCORRECTED else h["ecc_corrected"]


def nvmlDeviceGetRetiredPagesPendingStatus(h):
    raise NVMLError("Not Supported")  # Hopper: rows are remapped instead


def nvmlDeviceGetRemappedRows(h):
    return tuple(h["remap"])


def nvmlDeviceGetCurrPcieLinkGeneration(h):
    return h["gen"]


def nvmlDeviceGetMaxPcieLinkGeneration(h):
    return h["gen_max"]


def nvmlDeviceGetGpuMaxPcieLinkGeneration(h):
    return h["gen_gpu_max"]


def nvmlDeviceGetCurrPcieLinkWidth(h):
    return h["width"]


def nvmlDeviceGetMaxPcieLinkWidth(h):
    return h["width_max"]


def nvmlDeviceGetPcieReplayCounter(h):
    return h["replay"]


def nvmlDeviceGetTemperature(h, sensor):
    return h["temp"]


# What the gpu_processes module (roles/gpu_reclaim's freeing step) reads: an idle recorded GPU, so that a
# recovery on a host with this fake installed (tests/integration/test_self_healing.py) reaches the gate.
def nvmlDeviceGetMemoryInfo(h):
    return type("Memory", (), {"used": h.get("memory_used", 0), "total": h.get("memory_total", 85520809984)})


def nvmlDeviceGetUtilizationRates(h):
    return type("Utilization", (), {"gpu": h.get("utilization", 0), "memory": 0})


def nvmlDeviceGetComputeRunningProcesses(h):
    return []
