#!/usr/bin/env python3
"""`make test`'s stages, run by a few workers at once, the costliest first (tests/run_all.sh runs this).

The machine that runs the suite (2 cores) is CPU-bound while lab tests run: its time is the stages'
CPU over its cores, plus whatever part of the run keeps a core idle. Lanes fixed by hand left one: the
lane with the longest stages ran on alone at the end (at 4a3f8d3 the molecule + rollout lane ended
~10 min after the others). Here every stage is one job on a queue, longest first by its estimated CPU
(`Stage.cpu`: own + lab hosts' seconds from the last measured run; a stale figure only reorders the
queue), and WORKERS workers take the next one as they free up, so the cores stay busy to the end and
the last stages to start are the cheap ones.

Each worker owns one lab (HSX_LAB_ID): a stage that boots lab hosts boots them in its worker's lab,
which no other stage uses while it runs. The unit suite is split into SHARDS pytest runs of about
equal cost (`unit_shards`). Each stage runs in a cgroup of its own where cgroup v2 is at hand (root):
its line says its wall time and its CPU, its own processes' (what outlives it included) and its lab
hosts' (tests/lab/lab.py appends each host's to its lab's cpu-log). A stage's output goes to
.cache/stages/NAME.log and is printed whole when it ends. Every stage runs even when another failed;
exit 1 if any failed.

    tests/stages.py [--workers N] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = REPO / ".venv" / "bin"
LOGS = REPO / ".cache" / "stages"
WORKERS = 4
SHARDS = 3
# The lab tests and molecule scenarios that run as stages of their own (the unit shards leave them out).
LAB_MODULES = ("test_rollout", "test_incident", "test_self_healing", "test_fleet", "test_job_unit",
               "test_monitoring", "test_collection")
# Not in make test: one more real SGLang server start (20-90 s of CPU-bound imports) for what the lab
# does not run (the tiny Qwen2 target, hsx patch without Ansible): .venv/bin/pytest tests/integration/test_sglang_cpu.py
NOT_RUN = ("test_sglang_cpu",)
# CPU seconds of the unit suite's costliest modules (own and children's, quiet, 2026-12-07; the suite
# ~600 s in all): the shards are balanced on these, every other module counts UNIT_MODULE_CPU.
UNIT_MODULE_CPU = 2
UNIT_CPU = {
    "test_selfheal_rulebook": 73, "test_fleet_split_role": 67, "test_takeover_retire": 43, "test_takeover_play": 40,
    "test_canary_role": 38, "test_assignment_place": 27, "test_metrics_recover": 27, "test_takeover_resume_role": 17,
    "test_gpu_health_role": 14, "test_sglang_patch_role": 14, "test_storage_dumps": 14, "test_tiny": 12,
    "test_role_surface": 12, "test_storage_guard": 30, "test_sglang_crash": 10, "test_writerproc": 9,
}


@dataclass(frozen=True)
class Stage:
    name: str
    argv: tuple[str, ...]
    cpu: int  # estimated CPU seconds, own + lab hosts (fresh-clone runs of 2026-12-07/08, loaded): the queue's order


# How every stage runs pytest: quiet, no cache written into the checkout, the slowest tests named.
PYTEST_FLAGS = ("-q", "-p", "no:cacheprovider")


def pytest_argv(*args: str, durations: int = 5) -> tuple[str, ...]:
    return (str(BIN / "pytest"), *args, *PYTEST_FLAGS, f"--durations={durations}")


def pytest_stage(module: str, cpu: int) -> Stage:
    return Stage(Path(module).stem, pytest_argv(module), cpu)


def molecule_stage(cpu: int, *scenarios: str) -> Stage:
    return Stage(f"molecule {' '.join(scenarios)}", ("tests/molecule/run.sh", *scenarios), cpu)


def unit_shards(n: int) -> list[tuple[int, list[str]]]:
    """The unit suite (tests/unit, tests/sglang_cpu, the lab-free or light tests/integration modules) as
    n (estimated CPU, test files) of about equal estimated CPU (greedy, costliest first)."""
    files = sorted([*(REPO / "tests" / "unit").glob("test_*.py"), *(REPO / "tests" / "sglang_cpu").glob("test_*.py"),
                    *(REPO / "tests" / "integration").glob("test_*.py")])
    files = [f for f in files if f.stem not in LAB_MODULES + NOT_RUN]
    shards: list[tuple[int, list[str]]] = [(0, []) for _ in range(n)]
    for f in sorted(files, key=lambda f: -UNIT_CPU.get(f.stem, UNIT_MODULE_CPU)):
        i = min(range(n), key=lambda i: shards[i][0])
        shards[i] = (shards[i][0] + UNIT_CPU.get(f.stem, UNIT_MODULE_CPU), shards[i][1] + [str(f.relative_to(REPO))])
    return [(cpu, sorted(files)) for cpu, files in shards]


def stages() -> list[Stage]:
    unit = [Stage(f"pytest unit {i + 1}/{SHARDS}",
                  pytest_argv(*files, durations=8) + (f"--junitxml={LOGS / f'unit-{i + 1}.xml'}",), cpu)
            for i, (cpu, files) in enumerate(unit_shards(SHARDS))]
    integration = "tests/integration/"
    return [
        pytest_stage(integration + "test_rollout.py", 860),
        pytest_stage(integration + "test_self_healing.py", 1100),
        pytest_stage(integration + "test_incident.py", 460),
        molecule_stage(320, "sglang_server"),
        pytest_stage(integration + "test_fleet.py", 380),
        *unit,
        pytest_stage(integration + "test_job_unit.py", 290),
        molecule_stage(350, "assess", "gpu_reclaim", "sglang_patch", "shard_verify"),
        Stage("collection: ansible-test sanity, then its tarball", ("sh", "-c", "tools/collection/sanity.sh; a=$?; "
              f"{shlex.join(pytest_argv(integration + 'test_collection.py'))}; b=$?; "
              '[ "$a" -eq 0 ] && [ "$b" -eq 0 ]'), 180),
        pytest_stage(integration + "test_monitoring.py", 200),
        Stage("lint: ansible-lint (production profile)", (str(BIN / "ansible-lint"), "--profile", "production", "-q"), 70),
        Stage("lint: ruff", (str(BIN / "ruff"), "check", "."), 3),
    ]


class Runner:
    def __init__(self, labs: list[str]):
        self.labs = labs
        self.print_lock = threading.Lock()
        self.failed: list[str] = []
        self.active: set[Path] = set()  # the running stages' cgroups: killed whole if the run is stopped
        base = Path("/sys/fs/cgroup")
        self.cgroups = base if (base / "cgroup.controllers").exists() else base / "unified"

    def say(self, text: str) -> None:
        with self.print_lock:
            print(text, flush=True)

    def lab_cpu_log(self, lab: str) -> Path:
        env = {**os.environ, "HSX_LAB_ID": lab}
        out = subprocess.run([str(BIN / "python"), "tests/lab/lab.py", "cpu-log"], cwd=REPO, env=env,
                             capture_output=True, text=True)
        return Path(out.stdout.strip())

    def run(self, stage: Stage, lab: str) -> None:
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", stage.name).strip("-")
        log = LOGS / f"{slug}.log"
        cpu_log = self.lab_cpu_log(lab)
        lab_lines = len(cpu_log.read_text().splitlines()) if cpu_log.is_file() else 0
        group = self.cgroups / f"hsx-test-stage-{os.getpid()}-{slug}"
        argv: tuple[str, ...] = stage.argv
        try:
            group.mkdir()
            argv = ("sh", "-c", 'echo $$ >"$0/cgroup.procs" && exec "$@"', str(group), *argv)
            self.active.add(group)
        except OSError:
            group = None
        self.say(f"=== start {stage.name} (lab {lab or 'default'})")
        t0 = time.monotonic()
        with open(log, "wb") as out:
            rc = subprocess.call(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                 env={**os.environ, "HSX_LAB_ID": lab})
        wall = time.monotonic() - t0
        cpu = ""
        if group is not None:
            own = cgroup_cpu(group)
            hosts = sum(float(line.split()[1]) for line in (cpu_log.read_text().splitlines()[lab_lines:]
                                                            if cpu_log.is_file() else []) if len(line.split()) == 2)
            cpu = f" (CPU: {own:.0f} s its own, {hosts:.0f} s its lab hosts')"
            self.active.discard(group)
            release(group, self.cgroups)
        if rc != 0:
            self.failed.append(stage.name)
        text = log.read_text(errors="replace")
        self.say(f"=== {stage.name}\n{text.rstrip()}\n{'=== FAILED: ' + stage.name + chr(10) if rc else ''}"
                 f"=== {stage.name}: {wall:.0f} s{cpu}")

    def worker(self, lab: str, jobs: queue.Queue[Stage]) -> None:
        while True:
            try:
                stage = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                self.run(stage, lab)
            except Exception as e:  # noqa: BLE001 - a stage the runner could not run fails, the others go on
                self.failed.append(stage.name)
                self.say(f"=== FAILED: {stage.name}: the runner could not run it: {e!r}")

    def kill_all(self) -> None:
        """Every running stage's processes, killed at once (cgroup.kill), when the run itself is stopped."""
        for group in list(self.active):
            try:
                (group / "cgroup.kill").write_text("1")
            except OSError:
                pass


def cgroup_cpu(group: Path) -> float:
    try:
        stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) / 1e6
    except (OSError, KeyError, ValueError):
        return 0.0


def release(group: Path, parent: Path) -> None:
    """What outlived its stage (an SSH master, a server) goes to the parent group; the group goes."""
    try:
        for pid in (group / "cgroup.procs").read_text().split():
            (parent / "cgroup.procs").write_text(pid)
        group.rmdir()
    except OSError:
        pass


def worker_labs(n: int) -> list[str]:
    """n lab ids (one digit each; the first the caller's HSX_LAB_ID, default: the default lab)."""
    first = os.environ.get("HSX_LAB_ID", "")
    return [first, *[d for d in "97865432" if d != first]][:n]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only the stages whose name starts so")
    parser.add_argument("--list", action="store_true", help="print the stages in queue order, run nothing")
    args = parser.parse_args()
    chosen = sorted(stages(), key=lambda s: -s.cpu)
    if args.only:
        chosen = [s for s in chosen if any(s.name.startswith(o) for o in args.only)]
    if args.list:
        for s in chosen:
            print(f"{s.cpu:5d}  {s.name}: {' '.join(s.argv)}")
        return 0
    LOGS.mkdir(parents=True, exist_ok=True)
    jobs: queue.Queue[Stage] = queue.Queue()
    for s in chosen:
        jobs.put(s)
    runner = Runner(worker_labs(args.workers))
    threads = [threading.Thread(target=runner.worker, args=(lab, jobs), daemon=True) for lab in runner.labs]

    def stop(signum: int, _frame: object) -> None:
        runner.kill_all()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            threads[0].join(timeout=1) if threads[0].is_alive() else threads.pop(0)
    except KeyboardInterrupt:
        runner.kill_all()
        raise
    finally:
        for lab in runner.labs:
            subprocess.run([str(BIN / "python"), "tests/lab/lab.py", "down"], cwd=REPO, capture_output=True,
                           env={**os.environ, "HSX_LAB_ID": lab})
    for xml in sorted(LOGS.glob("unit-*.xml")):
        subprocess.run([str(BIN / "python"), "tests/junit_modules.py", str(xml), "--top", "8"], cwd=REPO)
    if runner.failed:
        print(f"=== FAILED stages: {', '.join(runner.failed)}")
    return 1 if runner.failed else 0


if __name__ == "__main__":
    sys.exit(main())
