"""library/gpu_processes.py: real child processes and real signals behind a fake NVML (processes as data).

The children open a file whose path starts with the test's device prefix (standing in for /dev/nvidia*),
so the module's "holds a GPU device" check runs on real /proc/PID/fd links.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pynvml
import pytest
from ansible.module_utils.testing import patch_module_args

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_processes", ROOT / "library" / "gpu_processes.py")
gp = importlib.util.module_from_spec(_spec)
sys.modules["gpu_processes"] = gp  # dataclasses look their module up there
_spec.loader.exec_module(gp)

GIB = 1 << 30
NOT_A_PID = 4194304  # above the largest pid_max Linux allows: can never be visible here

CHILD = """
import signal, sys, time
if sys.argv[2] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
held = open(sys.argv[1]) if sys.argv[1] != "-" else None
print("ready", flush=True)
time.sleep(600)
"""


@dataclass
class Holder:
    """One process NVML would list: on `gpu`, holding `used` bytes while `alive()`."""

    pid: int
    gpu: int
    used: int
    alive: object


class FakeNvml:
    """The NVML interface as plain data: a GPU's used memory = its base + what its live processes hold."""

    def __init__(self, holders: list[Holder], gpus: int = 1, base: int = GIB // 2, total: int = 140 * GIB):
        self.holders, self.n, self.base, self.total = holders, gpus, base, total
        self.calls = 0

    def gpus(self) -> list:
        self.calls += 1
        out = []
        for i in range(self.n):
            live = [h for h in self.holders if h.gpu == i and h.alive()]
            out.append(
                gp.Gpu(i, "Fake H200", f"GPU-fake-{i}", self.base + sum(h.used for h in live), self.total, 7,
                       [gp.GpuProc(h.pid, h.used) for h in live])
            )  # fmt: skip
        return out

    def close(self) -> None:
        pass


@pytest.fixture
def device(tmp_path, monkeypatch) -> Path:
    """A stand-in device file; the module treats paths under tmp_path/'nvidia' as GPU devices."""
    dev = tmp_path / "nvidia0"
    dev.write_text("")
    # The default prefix lives with GpuReclaimer (hsx.gpu_reclaim, as the module imported it).
    monkeypatch.setattr(sys.modules[gp.GpuReclaimer.__module__], "DEVICE_PREFIX", str(tmp_path / "nvidia"))
    return dev


@pytest.fixture
def spawn(device):
    """Start real children with a recognisable tag in their command line; all are reaped at the end."""
    children = []

    def start(tag: str, ignore_term: bool = False, hold_device: bool = True, extra: tuple = ()) -> subprocess.Popen:
        args = [str(device) if hold_device else "-", "ignore-term" if ignore_term else "term", tag, *extra]
        child = subprocess.Popen([sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        children.append(child)
        return child

    yield start
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait()


def holder(child: subprocess.Popen, gpu: int = 0, used: int = 20 * GIB) -> Holder:
    return Holder(child.pid, gpu, used, lambda: child.poll() is None)


def reclaimer(backend, **kw) -> gp.GpuReclaimer:
    kw.setdefault("grace_seconds", 5)
    kw.setdefault("timeout_seconds", 5)
    kw.setdefault("memory_threshold_mib", 1024)
    return gp.GpuReclaimer(backend, poll_seconds=0.05, **kw)


def by_pid(result: dict) -> dict[int, dict]:
    return {p["pid"]: p for p in result["processes"]}


# ---------------------------------------------------------------- the logic class
def test_present_lists_processes_and_gpus_and_touches_nothing(spawn):
    vllm, other = spawn("fake-vllm-serve"), spawn("trainer")
    nvml = FakeNvml([holder(vllm, 0), holder(vllm, 1, 10 * GIB), holder(other, 1, 3 * GIB)], gpus=2)
    result = reclaimer(nvml, patterns=["fake-vllm"]).run("present")
    assert result["changed"] is False and result["gpus"] == 2 and result["ended"] == []
    procs = by_pid(result)
    assert procs[vllm.pid]["gpus"] == [0, 1] and procs[vllm.pid]["used_memory_mib"] == 30 * 1024
    assert procs[vllm.pid]["cmdline"].endswith("term fake-vllm-serve") and procs[vllm.pid]["user"]
    assert (
        procs[vllm.pid]["visible"] and procs[vllm.pid]["holds_device"] and procs[vllm.pid]["action"] == "none"
    )
    dev = result["devices"]
    assert [d["memory_used_mib"] for d in dev] == [512 + 20 * 1024, 512 + 13 * 1024]
    assert dev[1]["pids"] == sorted([vllm.pid, other.pid]) and dev[0]["utilization_percent"] == 7
    assert vllm.poll() is None and other.poll() is None


def test_allowlist_ends_only_matching_and_second_run_is_a_noop(spawn):
    vllm, other = spawn("fake-vllm-serve"), spawn("trainer")
    nvml = FakeNvml([holder(vllm, 0), holder(other, 0, 256 << 20)])
    result = reclaimer(nvml, patterns=[r"fake-vllm\b"]).run("absent")
    assert result["changed"] and result["ended"] == [vllm.pid]
    assert vllm.wait(timeout=5) == -signal.SIGTERM
    assert other.poll() is None
    procs = by_pid(result)
    assert procs[vllm.pid]["action"] == "ended" and procs[vllm.pid]["signal"] == "SIGTERM"
    assert procs[other.pid]["action"] == "keep" and procs[other.pid]["reason"] == "not on the allowlist"
    assert (
        result["devices"][0]["memory_used_mib"] > 20000
        and result["devices_after"][0]["memory_used_mib"] < 1024
    )

    again = reclaimer(nvml, patterns=[r"fake-vllm\b"]).run("absent")
    assert again["changed"] is False and again["ended"] == [] and again["msg"].startswith("nothing to end")
    assert other.poll() is None


def test_force_ends_every_visible_process_but_never_a_protected_unit(spawn):
    a, b = spawn("job-a"), spawn("job-b")
    nvml = FakeNvml([holder(a), holder(b, used=GIB)])
    r = reclaimer(nvml, force=True)
    targets = r.targets(nvml.gpus())
    targets[1].info.unit = "hsx-sglang-server.service"  # as if /proc/PID/cgroup named our own server
    r.protect_units = {"hsx-sglang-server.service"}
    for t in targets:
        r.decide(t)
    assert [t.action for t in targets] == ["end", "keep"]
    assert targets[0].reason == "force" and "protected unit hsx-sglang-server.service" in targets[1].reason

    result = reclaimer(nvml, force=True, memory_threshold_mib=2048).run("absent")
    assert sorted(result["ended"]) == sorted([a.pid, b.pid])
    assert a.wait(timeout=5) and b.wait(timeout=5)


def test_unit_is_read_from_the_cgroup_path():
    unit = gp.ProcTable._unit
    assert unit("0::/system.slice/hsx-sglang-server.service\n") == "hsx-sglang-server.service"
    assert unit("12:pids:/\n1:name=systemd:/system.slice/vllm-kimi-k25-int4.service\n0::/\n") == (
        "vllm-kimi-k25-int4.service"
    )
    assert unit("0::/user.slice/user-0.slice/session-3.scope\n") == "session-3.scope"
    assert unit("0::/\n") is None


def test_sigterm_ignored_escalates_to_sigkill_after_the_grace_period(spawn):
    stubborn, polite = spawn("fake-vllm-stubborn", ignore_term=True), spawn("fake-vllm-polite")
    nvml = FakeNvml([holder(stubborn), holder(polite, used=GIB)])
    start = time.monotonic()
    result = reclaimer(nvml, patterns=["fake-vllm"], grace_seconds=0.6).run("absent")
    elapsed = time.monotonic() - start
    assert stubborn.wait(timeout=5) == -signal.SIGKILL and polite.wait(timeout=5) == -signal.SIGTERM
    procs = by_pid(result)
    assert procs[stubborn.pid]["signal"] == "SIGKILL" and procs[polite.pid]["signal"] == "SIGTERM"
    assert 0.6 <= elapsed < 3, elapsed
    assert "1 with SIGTERM only, 1 needed SIGKILL" in result["msg"]


def test_memory_that_stays_busy_fails_after_the_timeout_naming_what_holds_it(spawn):
    vllm, trainer = spawn("fake-vllm-serve"), spawn("trainer")
    nvml = FakeNvml([holder(vllm), holder(trainer, used=3 * GIB)])
    start = time.monotonic()
    with pytest.raises(gp.ReclaimError) as err:
        reclaimer(nvml, patterns=["fake-vllm"], grace_seconds=0.2, timeout_seconds=0.5).run("absent")
    assert 0.5 <= time.monotonic() - start < 3
    msg = str(err.value)
    assert "GPU 0 3584 MiB" in msg and f"pid {trainer.pid}" in msg and "not on the allowlist" in msg
    assert err.value.result["ended"] == [vllm.pid] and trainer.poll() is None
    assert vllm.wait(timeout=5) == -signal.SIGTERM


def test_busy_memory_with_nothing_to_end_fails_at_once(spawn):
    trainer = spawn("trainer")
    nvml = FakeNvml([holder(trainer, used=3 * GIB)])
    start = time.monotonic()
    with pytest.raises(gp.ReclaimError, match="nothing to end; GPU memory at or above 1024 MiB: GPU 0"):
        reclaimer(nvml, patterns=["fake-vllm"], timeout_seconds=30).run("absent")
    assert time.monotonic() - start < 2
    assert reclaimer(nvml, patterns=["fake-vllm"]).run("absent", wait=False)["changed"] is False


def test_invisible_pids_are_reported_and_never_signalled_even_with_force(spawn):
    nvml = FakeNvml([Holder(NOT_A_PID, 0, 70 * GIB, lambda: True)])
    with pytest.raises(gp.ReclaimError) as err:
        reclaimer(nvml, force=True).run("absent")
    (proc,) = err.value.result["processes"]
    assert proc["visible"] is False and proc["action"] == "keep" and proc["signal"] is None
    assert "not visible here" in proc["reason"] and f"pid {NOT_A_PID} (not visible)" in str(err.value)


def test_a_pid_that_holds_no_gpu_device_is_not_ended(spawn):
    """NVML's number may name another process here (pid reuse, other namespace): never guess."""
    imposter = spawn("fake-vllm-imposter", hold_device=False)
    nvml = FakeNvml([holder(imposter)])
    result = reclaimer(nvml, patterns=["fake-vllm"]).run("absent", wait=False)
    (proc,) = result["processes"]
    assert proc["holds_device"] is False and proc["action"] == "keep" and "does not hold" in proc["reason"]
    assert imposter.poll() is None and result["changed"] is False


def test_command_lines_are_reported_redacted_everywhere(spawn, capsys, monkeypatch):
    """#30 item 8: `vllm serve --api-key ...` is never printed or stored as given (hsx.redact)."""
    secrets = ("--api-key", "s3cret-1", "--hf-token=s3cret-2", "HF_TOKEN=s3cret-3")
    vllm = spawn("fake-vllm-serve", extra=secrets)
    trainer = spawn("trainer", extra=("--db-password", "s3cret-4"))
    nvml = FakeNvml([holder(vllm), holder(trainer, used=3 * GIB)])
    listed = reclaimer(nvml, patterns=["fake-vllm"]).run("present")
    assert "s3cret" not in json.dumps(listed)
    assert by_pid(listed)[vllm.pid]["cmdline"].endswith(
        "fake-vllm-serve --api-key <redacted> --hf-token=<redacted> HF_TOKEN=<redacted>")
    monkeypatch.setattr(gp, "PynvmlBackend", lambda: nvml)
    out = run_module(capsys, state="absent", patterns=["fake-vllm"], grace_seconds=1, timeout_seconds=0.5,
                     memory_threshold_mib=1024)
    assert out["failed"] and f"pid {trainer.pid}" in out["msg"] and "--db-password <redacted>" in out["msg"]
    assert "s3cret" not in json.dumps(out)
    assert vllm.wait(timeout=5) == -signal.SIGTERM  # the allowlist still matches the redacted line


def test_zombies_and_exited_processes_count_as_gone(spawn):
    child = spawn("fake-vllm-serve")
    child.kill()
    time.sleep(0.2)  # not reaped yet: a zombie
    info = gp.ProcTable().info(child.pid)
    assert info.visible is False
    assert gp.ProcTable().alive(child.pid, None) is False


def test_check_mode_lists_what_would_be_ended_and_signals_nothing(spawn):
    vllm = spawn("fake-vllm-serve")
    nvml = FakeNvml([holder(vllm)])
    result = reclaimer(nvml, patterns=["fake-vllm"]).run("absent", check_mode=True)
    assert result["changed"] and result["ended"] == [vllm.pid]
    assert by_pid(result)[vllm.pid]["action"] == "would end" and by_pid(result)[vllm.pid]["signal"] is None
    assert result["msg"].endswith("would end 1")
    time.sleep(0.2)
    assert vllm.poll() is None


# ---------------------------------------------------------------- the Ansible module
def run_module(capsys, **args) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        gp.main()
    return json.loads(capsys.readouterr().out)


def test_module_check_mode_through_ansible(spawn, capsys, monkeypatch):
    vllm = spawn("fake-vllm-serve")
    nvml = FakeNvml([holder(vllm)])
    monkeypatch.setattr(gp, "PynvmlBackend", lambda: nvml)
    out = run_module(capsys, state="absent", patterns=["fake-vllm"], _ansible_check_mode=True)
    assert out["changed"] and out["ended"] == [vllm.pid] and out["processes"][0]["action"] == "would end"
    assert vllm.poll() is None

    out = run_module(
        capsys, state="absent", patterns=["fake-vllm"], grace_seconds=2, memory_threshold_mib=1024
    )
    assert out["changed"] and not out.get("failed") and vllm.wait(timeout=5) == -signal.SIGTERM
    assert out["devices_after"][0]["memory_used_mib"] == 512


def test_module_timeout_fails_with_the_holders(spawn, capsys, monkeypatch):
    trainer = spawn("trainer")
    monkeypatch.setattr(gp, "PynvmlBackend", lambda: FakeNvml([holder(trainer)]))
    out = run_module(capsys, state="absent", patterns=["fake-vllm"], memory_threshold_mib=1024)
    assert out["failed"] and f"pid {trainer.pid}" in out["msg"] and out["gpus"] == 1


def test_no_driver_with_the_real_library_is_gpus_0_unless_required(capsys):
    """Here nvidia-ml-py is installed and there is no driver: the real NVML init fails."""
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present here")
    except pynvml.NVMLError:
        pass
    out = run_module(capsys, state="absent", force=True)
    assert out["gpus"] == 0 and not out.get("failed") and out["changed"] is False
    assert "NVML could not start" in out["nvml"] and out["processes"] == []
    out = run_module(capsys, require_gpus=True)
    assert out["failed"] and out["msg"].startswith("require_gpus: NVML could not start")


def test_missing_library_names_the_package_when_a_driver_is_present(capsys, monkeypatch):
    monkeypatch.setattr(gp, "pynvml", None)
    monkeypatch.setattr(gp, "PYNVML_IMPORT_ERROR", "ModuleNotFoundError: No module named 'pynvml'")
    monkeypatch.setattr(gp, "driver_present", lambda: True)
    out = run_module(capsys)
    assert out["failed"] and "nvidia-ml-py" in out["msg"]
    monkeypatch.setattr(gp, "driver_present", lambda: False)
    out = run_module(capsys)
    assert not out.get("failed") and out["gpus"] == 0 and "no NVIDIA driver" in out["nvml"]
    out = run_module(capsys, require_gpus=True)
    assert out["failed"] and "nvidia-ml-py" in out["msg"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"state": "absent"}, "needs patterns (an allowlist) or force=true"),
        ({"patterns": ["vllm("]}, "'vllm(' is not a valid regular expression"),
        ({"grace_seconds": -1}, "grace_seconds must be >= 0"),
    ],
)
def test_bad_arguments_are_named(capsys, args, message):
    out = run_module(capsys, **args)
    assert out["failed"] and message in out["msg"]


def test_pynvml_backend_translates_nvml_to_plain_data():
    """The real backend against a stand-in pynvml: bytes names, NVML's 'not available' memory, no utilisation."""

    class Stub:
        NVMLError = pynvml.NVMLError

        def nvmlInit(self):
            pass

        def nvmlShutdown(self):
            pass

        def nvmlDeviceGetCount(self):
            return 1

        def nvmlDeviceGetHandleByIndex(self, i):
            return i

        def nvmlDeviceGetMemoryInfo(self, h):
            return type("M", (), {"used": 3 * GIB, "total": 140 * GIB})()

        def nvmlDeviceGetUtilizationRates(self, h):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

        def nvmlDeviceGetComputeRunningProcesses(self, h):
            return [
                type("P", (), {"pid": 11, "usedGpuMemory": GIB})(),
                type("P", (), {"pid": 12, "usedGpuMemory": None})(),
            ]

        def nvmlDeviceGetName(self, h):
            return b"NVIDIA H200"

        def nvmlDeviceGetUUID(self, h):
            return "GPU-1"

    (g,) = gp.PynvmlBackend(Stub()).gpus()
    assert (g.name, g.uuid, g.used_bytes, g.utilization) == ("NVIDIA H200", "GPU-1", 3 * GIB, None)
    assert [(p.pid, p.used_bytes) for p in g.processes] == [(11, GIB), (12, None)]
