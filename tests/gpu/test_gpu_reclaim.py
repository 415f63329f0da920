"""GPU reclaim on a real NVIDIA GPU (never in CI): the module's logic against real NVML and real CUDA processes.

Run on the GPU machine (torch + nvidia-ml-py; Ansible is not needed):

    python3 tests/gpu/test_gpu_reclaim.py          # prints the figures, exit 0 = passed
    python3 -m pytest tests/gpu -q -s              # the same as a test (skipped without a GPU)

What it does: starts CUDA child processes that hold GPU memory under recognisable command lines, then
drives GpuReclaimer (library/gpu_processes.py, imported without Ansible) through real NVML:
  1. a 'vLLM-like' holder (allowlisted) and a bystander (not allowlisted) are listed with pid, user,
     command line and memory;
  2. state=absent with the allowlist ends the holder (SIGTERM), GPU memory drops below the threshold,
     the bystander is left alone;
  3. a second run is a no-op (nothing ended, changed=False);
  4. a holder that ignores SIGTERM is ended with SIGKILL after the grace period.
Environment: HSX_GPU_TEST_GIB (default 20) sets the holder's allocation.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOLD_GIB = float(os.environ.get("HSX_GPU_TEST_GIB", "20"))
MIB = 1 << 20

HOLDER = r"""
import signal, sys, time
import torch
if sys.argv[2] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
x = torch.empty(int(float(sys.argv[1]) * (1 << 30)), dtype=torch.uint8, device="cuda:0")
x.fill_(1)
torch.cuda.synchronize()
print("ready", flush=True)
time.sleep(3600)
"""


def load_module():
    """library/gpu_processes.py as a plain Python module (it imports without Ansible; its /proc
    helpers then come from the hsx package: this checkout's module_utils/hsx)."""
    if str(ROOT / "module_utils") not in sys.path:
        sys.path.insert(0, str(ROOT / "module_utils"))
    spec = importlib.util.spec_from_file_location("gpu_processes", ROOT / "library" / "gpu_processes.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_processes"] = mod
    spec.loader.exec_module(mod)
    return mod


def gpu_problem() -> str | None:
    """Why this machine cannot run the test, or None."""
    try:
        import pynvml
        import torch
    except ImportError as e:
        return f"needs torch and nvidia-ml-py: {e}"
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as e:
        return f"no NVIDIA driver/GPU: {e}"
    if count == 0 or not torch.cuda.is_available():
        return "no CUDA GPU"
    return None


def start_holder(tag: str, gib: float, ignore_term: bool = False) -> subprocess.Popen:
    """A CUDA process holding `gib` GiB on GPU 0, with `tag` in its command line."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(gib), "ignore-term" if ignore_term else "term", tag],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = child.stdout.readline().strip()
    if line != "ready":
        child.kill()
        raise RuntimeError(f"holder {tag} did not start (exit {child.wait()})")
    return child


def wait_listed(backend, pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.pid == pid for g in backend.gpus() for p in g.processes):
            return
        time.sleep(0.2)
    listed = [p.pid for g in backend.gpus() for p in g.processes]
    raise AssertionError(
        f"NVML does not list pid {pid} (it lists {listed}): NVML's pids may be another PID namespace's"
    )


def used_mib(backend) -> int:
    return backend.gpus()[0].used_bytes // MIB


def show(result: dict) -> None:
    for p in result["processes"]:
        print(
            f"    pid {p['pid']:>7} {str(p['user']):<8} gpus {p['gpus']} {str(p['used_memory_mib']):>6} MiB "
            f"visible={p['visible']} device={p['holds_device']} -> {p['action']:<9} {p['signal'] or '':<7} "
            f"{p['reason']} | {(p['cmdline'] or '')[-60:]}"
        )


def run_checks() -> None:
    gp = load_module()
    backend = gp.PynvmlBackend()
    children: list[subprocess.Popen] = []
    try:
        g0 = backend.gpus()[0]
        print(
            f"GPU 0: {g0.name}, {g0.total_bytes // MIB} MiB total, {g0.used_bytes // MIB} MiB used at start"
        )
        bystander = start_holder("hsx-gpu-test-bystander", 1)
        children.append(bystander)
        wait_listed(backend, bystander.pid)
        base = used_mib(backend)
        threshold = base + 4096  # the bystander stays: free means back near this level
        print(f"with the bystander (1 GiB, not allowlisted): {base} MiB used; threshold {threshold} MiB")

        holder = start_holder("hsx-gpu-test-vllm-serve", HOLD_GIB)
        children.append(holder)
        wait_listed(backend, holder.pid)
        busy = used_mib(backend)
        print(f"with the holder ({HOLD_GIB:g} GiB, allowlisted): {busy} MiB used")
        assert busy >= threshold, (
            f"the holder did not raise memory above the threshold ({busy} < {threshold})"
        )

        def reclaimer(**kw):
            kw.setdefault("grace_seconds", 15)
            kw.setdefault("timeout_seconds", 60)
            return gp.GpuReclaimer(
                backend, patterns=[r"hsx-gpu-test-vllm"], memory_threshold_mib=threshold, **kw
            )

        listing = reclaimer().run("present")
        print("1. state=present:")
        show(listing)
        mine = {p["pid"]: p for p in listing["processes"]}
        assert mine[holder.pid]["visible"] and mine[holder.pid]["holds_device"], mine[holder.pid]
        assert "hsx-gpu-test-vllm-serve" in mine[holder.pid]["cmdline"]
        assert (
            mine[holder.pid]["used_memory_mib"] is None
            or mine[holder.pid]["used_memory_mib"] >= HOLD_GIB * 1024
        )

        check = reclaimer().run("absent", check_mode=True)
        assert check["ended"] == [holder.pid] and holder.poll() is None, check["msg"]
        print(f"   check mode: {check['msg']}; holder still running")

        start = time.monotonic()
        result = reclaimer().run("absent")
        took = time.monotonic() - start
        after = result["devices_after"][0]["memory_used_mib"]
        print(f"2. state=absent: {result['msg']} in {took:.2f} s; {busy} -> {after} MiB")
        show(result)
        assert result["changed"] and result["ended"] == [holder.pid]
        assert holder.wait(timeout=10) is not None
        assert after < threshold
        assert bystander.poll() is None, "the bystander (not allowlisted) was ended"

        start = time.monotonic()
        again = reclaimer().run("absent")
        print(
            f"3. second run: changed={again['changed']} ended={again['ended']} ({time.monotonic() - start:.2f} s)"
        )
        assert again["changed"] is False and again["ended"] == [] and bystander.poll() is None

        stubborn = start_holder("hsx-gpu-test-vllm-stubborn", 4, ignore_term=True)
        children.append(stubborn)
        wait_listed(backend, stubborn.pid)
        start = time.monotonic()
        result = reclaimer(grace_seconds=2).run("absent")
        took = time.monotonic() - start
        sig = {p["pid"]: p["signal"] for p in result["processes"]}[stubborn.pid]
        print(f"4. SIGTERM ignored: {result['msg']} in {took:.2f} s (grace 2 s); last signal {sig}")
        assert sig == "SIGKILL" and stubborn.wait(timeout=10) is not None and 2 <= took
        assert result["devices_after"][0]["memory_used_mib"] < threshold and bystander.poll() is None
        print(f"PASSED {time.strftime('%Y-%m-%d %H:%M:%S')}")
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
        backend.close()


def test_gpu_reclaim():
    import pytest

    problem = gpu_problem()
    if problem:
        pytest.skip(problem)
    run_checks()


if __name__ == "__main__":
    problem = gpu_problem()
    if problem:
        print(f"SKIPPED: {problem}")
        sys.exit(0)
    try:
        run_checks()
    except AssertionError as e:
        print(f"FAILED: {e}")
        sys.exit(1)
