#!/usr/bin/env python3
"""Concurrent CPU extractions with torch's default threads vs one thread each, side by side.

Why the lab pins OMP_NUM_THREADS=1 for its jobs (inventory/lab/group_vars/all/main.yml): `make test`
runs three lanes of lab hosts on a machine of few cores, so several tiny extractions share them.
This runs N `hsx extract` of the lab's tiny model and dataset at once (the lab's options), first
with torch's default threads, then with OMP_NUM_THREADS=1, interleaved R times, and prints each
run's wall and CPU seconds and the medians. Needs the lab assets (.cache/lab-assets: any lab test
or `make demo` builds them).

    .venv/bin/python tests/bench/bench_lab_threads.py [--jobs 3] [--repeat 1]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / ".cache" / "lab-assets"
HSX = Path(sys.executable).parent / "hsx"


def extract(output: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [str(HSX), "extract", "--model", str(ASSETS / "tiny-dsv3"), "--dataset", str(ASSETS / "tiny-256.jsonl"),
         "--output", str(output), "--layers", "1,3,4", "--dtype", "fp32", "--max-length", "512",
         "--batch-size", "8", "--reserve-bytes", "16M", "--progress", "off"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def batch(jobs: int, threads: str | None, tmp: Path) -> tuple[list[float], float]:
    """`jobs` extractions at once: (each one's wall seconds, their CPU seconds together)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("OMP_NUM_THREADS", None)
    if threads:
        env["OMP_NUM_THREADS"] = threads
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    procs = [extract(tmp / f"{threads or 'default'}-{time.monotonic_ns()}-{i}", env) for i in range(jobs)]
    walls = []
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"hsx extract failed (rc {proc.returncode})")
        walls.append(time.monotonic() - t0)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return walls, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    if not (ASSETS / "tiny-256.jsonl").is_file():
        raise SystemExit(f"{ASSETS / 'tiny-256.jsonl'} missing: run a lab test or `make demo` first")
    results: dict[str, list[tuple[list[float], float]]] = {"default": [], "1": []}
    with tempfile.TemporaryDirectory(prefix="hsx-bench-threads-") as tmp:
        for _ in range(args.repeat):  # interleaved: both see the same machine
            results["default"].append(batch(args.jobs, None, Path(tmp)))
            results["1"].append(batch(args.jobs, "1", Path(tmp)))
    print(f"{args.jobs} tiny extractions at once (256 samples each), {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}:")
    medians = {}
    for name, runs in results.items():
        walls = [w for ws, _ in runs for w in ws]
        cpus = [c / args.jobs for _, c in runs]
        medians[name] = statistics.median(walls), statistics.median(cpus)
        label = "torch default threads" if name == "default" else "OMP_NUM_THREADS=1   "
        print(f"  {label}: wall median {medians[name][0]:.1f} s (runs {[round(w, 1) for w in walls]}), "
              f"CPU per job median {medians[name][1]:.1f} s")
    print(f"  default / one thread: wall {medians['default'][0] / medians['1'][0]:.2f}x, "
          f"CPU {medians['default'][1] / medians['1'][1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
