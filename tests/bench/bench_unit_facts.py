#!/usr/bin/env python3
"""A lab host's CPU for one read of its service units: ansible.builtin.service_facts vs our
service_unit_facts (library/service_unit_facts.py), interleaved, with a plain module task as the floor.

Why the roles read units with service_unit_facts: on a systemd host service_facts also runs `service
--status-all` (every SysV script's status) and one `systemctl show` per unloaded unit file; a recovery
reads the units three times per host. Boots one lab host (HSX_LAB_ID, default 6; needs root), runs R
rounds of N tasks of each module and reads the host's cgroup CPU (cgroup v2 cpu.stat) around each
batch; prints each batch's seconds per task and the medians. Tears the host down after.

    HSX_LAB_ID=6 .venv/bin/python tests/bench/bench_unit_facts.py [--tasks 5] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("HSX_LAB_ID", "6")

from labctl import _lab_module, host, lab, playbook  # noqa: E402

MODULES = {"service_facts": "ansible.builtin.service_facts", "service_unit_facts": "service_unit_facts",
           "stat (floor)": "ansible.builtin.stat"}


def host_cpu(name: str) -> float:
    """The host's CPU seconds so far: its cgroup's (lab.py puts each host in one)."""
    mod = _lab_module()
    for root in mod.cgroup_roots():
        try:
            return mod.cgroup_cpu_seconds(root / name)
        except (OSError, KeyError, ValueError):  # the name=systemd hierarchy: no cpu.stat
            continue
    raise SystemExit(f"no cpu.stat for {name} (cgroup v2 needed)")


def batch(name: str, module: str, tasks: int, tmp: Path) -> float:
    """Seconds of the host's CPU per task, for `tasks` runs of `module`."""
    args = {"path": "/etc"} if module.endswith(".stat") else {}
    play = [{"hosts": name, "gather_facts": False,
             "tasks": [{"name": "read", module: args, "loop": list(range(tasks))}]}]
    path = tmp / "play.yml"
    path.write_text(json.dumps(play))
    before = host_cpu(name)
    run = playbook(str(path))
    if run.rc != 0:
        raise SystemExit(run.output[-3000:])
    return (host_cpu(name) - before) / tasks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    name = host(1)
    lab("up", "1")
    try:
        got: dict[str, list[float]] = {label: [] for label in MODULES}
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.repeat):
                for label, module in MODULES.items():
                    seconds = batch(name, module, args.tasks, Path(tmp))
                    got[label].append(seconds)
                    print(f"round {r + 1}: {label:20s} {seconds:.3f} s of the host's CPU a task", flush=True)
        for label, values in got.items():
            print(f"{label:20s} median {statistics.median(values):.3f} s a task "
                  f"(min {min(values):.3f}, max {max(values):.3f}; {args.repeat} x {args.tasks})")
        ratio = statistics.median(got["service_facts"]) / statistics.median(got["service_unit_facts"])
        print(f"service_facts / service_unit_facts: {ratio:.2f}x")
    finally:
        lab("down", check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
