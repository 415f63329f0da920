#!/usr/bin/env python3
"""Lab boot time: 1 host vs N hosts, side by side in one run (boot = `up` until every host's
`systemctl is-system-running --wait` says running over SSH). Usage: bench_lab.py [N] [--repeat R]."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

LAB = Path(__file__).resolve().parents[1] / "lab" / "lab.py"


def boot(count: int) -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, str(LAB), "up", str(count)], check=True, capture_output=True)
    elapsed = time.monotonic() - t0
    subprocess.run([sys.executable, str(LAB), "down"], check=True, capture_output=True)
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("hosts", type=int, nargs="?", default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    subprocess.run([sys.executable, str(LAB), "ensure"], check=True, capture_output=True)
    ones, many = [], []
    for _ in range(args.repeat):  # interleaved, so both see the same machine load
        ones.append(boot(1))
        many.append(boot(args.hosts))
    m1, mn = statistics.median(ones), statistics.median(many)
    print(f"lab boot 1 host : median {m1:.2f}s  runs {[round(x, 2) for x in ones]}")
    print(f"lab boot {args.hosts} hosts: median {mn:.2f}s  runs {[round(x, 2) for x in many]}")
    print(f"ratio {args.hosts} hosts / 1 host: {mn / m1:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
