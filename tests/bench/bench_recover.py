#!/usr/bin/env python3
"""recover.yml on real lab hosts: planted crash -> "extraction making progress", then a no-op
recover.yml on 1 host vs 4 hosts, interleaved in one run (the machine's load hits both alike).

1. Boot N lab hosts (default 4), plant the incident on all of them (tests/plays/plant_incident.yml).
2. `recover.yml --limit <host 1>`: the time from the start of the run to the end of the task
   "Wait until the job is making progress" is crash -> progress (it includes deploying the venv,
   verifying and quarantining shards, stopping the fake vLLM unit).
3. `recover.yml` on all hosts recovers the others; wait until every extraction is done, so the
   jobs' CPU use does not weigh on the no-op runs.
4. No-op runs, interleaved: `--limit <host 1>` then all N, `--repeat` times; each must report
   changed=0 on every host (else the figure would not be a no-op's and the bench fails).

Usage: bench_recover.py [--hosts 4] [--repeat 3]   (root; HSX_LAB_ID picks a parallel lab)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from labctl import BIN, REPO, PlaybookRun, host, lab, lab_ssh, playbook  # noqa: E402

PROGRESS_TASK = "TASK [extraction_job : Wait until the job is making progress]"


def timed_playbook(*args: str) -> tuple[PlaybookRun, float, float | None]:
    """Run ansible-playbook, streaming; returns the run, its wall time and when PROGRESS_TASK ended."""
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", ANSIBLE_NOCOLOR="1")
    t0 = time.monotonic()
    proc = subprocess.Popen([str(BIN / "ansible-playbook"), *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines, in_wait, progress_at = [], False, None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(PROGRESS_TASK):
            in_wait = True
        elif in_wait and line.startswith(("TASK [", "PLAY [", "PLAY RECAP")):
            in_wait, progress_at = False, time.monotonic() - t0
    rc = proc.wait()
    return PlaybookRun(rc, "".join(lines)), time.monotonic() - t0, progress_at


def wait_all_done(hosts: list[str], timeout: float = 1200) -> None:
    deadline = time.monotonic() + timeout
    pending = set(hosts)
    while pending and time.monotonic() < deadline:
        for h in sorted(pending):
            out = lab_ssh(h, "/opt/hsx/venv/bin/hsx status /data/hsx/output --json").stdout
            if out.strip().startswith("{") and json.loads(out)["outputs"][0].get("state") == "done":
                pending.discard(h)
        time.sleep(3)
    if pending:
        raise SystemExit(f"extraction not done after {timeout:.0f}s on {sorted(pending)}")


def require_noop(run: PlaybookRun, hosts: list[str]) -> None:
    recap = run.recap()
    bad = {h: recap.get(h) for h in hosts if not recap.get(h) or recap[h]["changed"] or recap[h]["failed"]}
    if run.rc != 0 or bad:
        raise SystemExit(f"not a no-op run (rc {run.rc}): {bad}\n{run.output[-3000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    hosts = [host(i) for i in range(1, args.hosts + 1)]
    lab("up", str(args.hosts), "--data-size", "1G")
    try:
        planted = playbook("tests/plays/plant_incident.yml")
        if planted.rc != 0:
            raise SystemExit(planted.output[-3000:])
        first, first_s, progress_s = timed_playbook("recover.yml", "--limit", hosts[0])
        if first.rc != 0 or progress_s is None:
            raise SystemExit(f"recover.yml on {hosts[0]} failed:\n{first.output[-3000:]}")
        print(f"crash -> extraction making progress ({hosts[0]}): {progress_s:.1f}s (whole run {first_s:.1f}s)")
        rest, rest_s, _ = timed_playbook("recover.yml")
        if rest.rc != 0:
            raise SystemExit(f"recover.yml on all hosts failed:\n{rest.output[-3000:]}")
        print(f"first recover.yml on all {args.hosts} hosts ({args.hosts - 1} still crashed): {rest_s:.1f}s")
        wait_all_done(hosts)
        one, many = [], []
        for _ in range(args.repeat):
            run, seconds, _ = timed_playbook("recover.yml", "--limit", hosts[0])
            require_noop(run, hosts[:1])
            one.append(seconds)
            run, seconds, _ = timed_playbook("recover.yml")
            require_noop(run, hosts)
            many.append(seconds)
        m1, mn = statistics.median(one), statistics.median(many)
        print(f"no-op recover.yml, 1 host : median {m1:.1f}s  runs {[round(x, 1) for x in one]}")
        print(f"no-op recover.yml, {args.hosts} hosts: median {mn:.1f}s  runs {[round(x, 1) for x in many]}")
        print(f"ratio {args.hosts} hosts / 1 host: {mn / m1:.2f}x; load average {os.getloadavg()[0]:.1f}")
    finally:
        lab("down", check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
