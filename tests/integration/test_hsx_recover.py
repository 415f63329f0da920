"""`hsx recover` and `hsx fleet-status` against real lab hosts, all planted with the incident.

<lab>-1: recovered by the plain `ansible-playbook recover.yml`; <lab>-2: by `hsx recover` (the two
reports must agree); <lab>-3: `hsx recover` while its link is cut mid-run (unreachable, exit 1),
so its crashed job stays stopped; then `hsx fleet-status` over the three must mark <lab>-3 only.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
from labctl import BIN, REPO, WHEELHOUSE, lab, playbook

PREFIX = f"hsxlab{os.environ.get('HSX_LAB_ID', '')}"
PLAIN, VIA_HSX, CUT = (f"{PREFIX}-{i}" for i in (1, 2, 3))
# A link that goes down mid-task must end the connection in seconds, not after TCP gives up.
SSH_ARGS = "-o ControlMaster=auto -o ControlPersist=60s -o ServerAliveInterval=2 -o ServerAliveCountMax=3"


def hsx(*args: str, on_line=None, timeout: int = 900) -> tuple[int, str]:
    """Run `hsx ...` (not a terminal: line-by-line progress); `on_line` sees each line as it comes."""
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", ANSIBLE_SSH_ARGS=SSH_ARGS)
    proc = subprocess.Popen(
        [str(BIN / "hsx"), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines = []
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if on_line:
                on_line(line)
        return proc.wait(), "".join(lines)
    finally:
        timer.cancel()


def link(host: str, state: str) -> None:
    """Take a lab host's veth (the only way to reach it) down or up."""
    index = host.rsplit("-", 1)[1]
    subprocess.run(["ip", "link", "set", f"hxl{os.environ.get('HSX_LAB_ID', '')}-{index}", state], check=True)


def mask_job_state(text: str) -> str:
    """A tiny job still running and one already finished cleanly, read alike (numbers masked
    first): it may finish before one report is written and not before the other. A failed job
    still reads differently."""
    text = re.sub(r"(N/N) \((?:running|done)\)", r"\1 (STATE)", text)  # progress cells
    # Job cell, job check: the unit may still be active for a moment after the job wrote "done".
    text = re.sub(r"\b(?:active, running|active, done|inactive, done)\b", "running or done", text)
    return text.replace(" (N written, N already there)", "")  # the finished job's message


def essentials(report: dict, host: str) -> dict:
    """What two recoveries of identically planted hosts must agree on: the verdict, every check's
    name, verdict and detail (numbers that move with time or the host's disk masked), the state
    found before. Not: device names, free bytes, the job's rate or how far it has got since, nor
    whether the tiny job is still running or has already finished (either is a recovered job;
    a failed one still differs)."""
    def mask(text: str) -> str:
        return mask_job_state(re.sub(r"\d+(?:\.\d+)?", "N", text.replace(host, "HOST")))

    job = report["after"]["job"]
    state = job.get("active_state")

    moving = {"storage", "job"}  # free bytes and samples done/rate differ by host and by second
    return {
        "ok": report["ok"],
        "checks": [(c["name"], c["ok"], mask(c["detail"]) if c["name"] in moving else c["detail"].replace(host, "HOST"))
                   for c in report["checks"]],
        "before_progress": {k: report["before"]["progress"][k] for k in ("done", "total")},
        "before_units": report["before"].get("units_running"),
        "after_job": {
            **{k: job.get(k) for k in ("unit", "started", "restarted")},
            "active_state": "running or done" if state in ("active", "inactive") else state,
        },
        "after_changes": {k: report["after"][k] for k in ("shards_quarantined", "units_changed", "processes_ended")},
    }


def summary_body(text: str, host: str) -> str:
    """summary.md without its title line, the host's name, the numbers that move and whether the
    tiny job was still running (mask_job_state)."""
    body = text.replace(host, "HOST").split("\n", 1)[1]
    return mask_job_state(re.sub(r"\d+(?:\.\d+)?", "N", body))


@pytest.fixture(scope="module")
def planted():
    lab("up", "3", "--data-size", "1G")
    try:
        run = playbook("tests/plays/plant_incident.yml")
        assert run.rc == 0, run.output[-3000:]
        # Built now, so that neither recovery below counts a wheelhouse rebuild the other does not.
        subprocess.run([str(BIN / "hsx"), "wheelhouse", str(WHEELHOUSE)], check=True, capture_output=True)
        yield
    finally:
        lab("down", check=False)


def test_hsx_recover_matches_the_plain_playbook(planted, tmp_path):
    plain = playbook("recover.yml", "--limit", PLAIN, "-e", f"hsx_report_dir={tmp_path / 'plain'}")
    rc, out = hsx("recover", "--limit", VIA_HSX, "--report-dir", str(tmp_path / "hsx"))

    assert plain.rc == 0, plain.output[-3000:]
    assert rc == 0, out[-3000:]
    assert f"{VIA_HSX}: stage shard_verify" in out and f"{VIA_HSX}: changed: " in out
    assert re.search(rf"^{VIA_HSX}\s+ok\s+ok=\d+ changed=\d+ failed=0", out, re.M), out[-2000:]
    recap = plain.recap()[PLAIN]
    (plain_dir,) = (tmp_path / "plain").iterdir()
    (hsx_dir,) = [p for p in (tmp_path / "hsx").iterdir() if not p.name.startswith(".")]
    a = json.loads((plain_dir / f"{PLAIN}.json").read_text())
    b = json.loads((hsx_dir / f"{VIA_HSX}.json").read_text())
    assert a["ok"] and b["ok"]
    assert essentials(a, PLAIN) == essentials(b, VIA_HSX)
    assert "3 quarantined" in dict((c["name"], c["detail"]) for c in b["checks"])["shards"]
    summary = (hsx_dir / "summary.md").read_text()
    assert summary in out, "hsx recover must print the playbook's summary"
    assert summary_body(summary, VIA_HSX) == summary_body((plain_dir / "summary.md").read_text(), PLAIN)
    # Same counts, but for the control node's wheelhouse build: it counts as changed for whichever
    # run finds the package's sources edited (a developer editing during the test), never for both.
    plain_build = bool(re.search(r"Build the wheelhouse on the control node\] \**\nchanged:", plain.output))
    hsx_build = bool(re.search(rf"^{VIA_HSX}: changed: .*Build the wheelhouse on the control node", out, re.M))
    counts = re.search(rf"^{VIA_HSX}\s+ok\s+ok=(\d+) changed=(\d+) failed=0", out, re.M)
    assert int(counts[1]) == recap["ok"], out[-2000:]
    assert int(counts[2]) - hsx_build == recap["changed"] - plain_build, (out[-2000:], plain.output[-2000:])
    artifacts = list((tmp_path / "hsx" / ".runner" / "artifacts").iterdir())
    command = json.loads((artifacts[0] / "command").read_text())
    assert "env" not in command and not (tmp_path / "hsx" / ".runner" / "env").exists()


def test_a_host_cut_off_mid_run_is_unreachable_exit_1(planted, tmp_path):
    cut = threading.Event()

    def cut_at_gpu_reclaim(line: str) -> None:
        if not cut.is_set() and line.startswith(f"{CUT}: stage gpu_reclaim"):
            cut.set()
            link(CUT, "down")

    try:
        rc, out = hsx("recover", "--limit", CUT, "--report-dir", str(tmp_path), on_line=cut_at_gpu_reclaim)
    finally:
        link(CUT, "up")
    assert cut.is_set(), out[-3000:]
    assert rc == 1, out[-3000:]
    assert f"{CUT}: UNREACHABLE at gpu_reclaim" in out, out[-3000:]
    assert re.search(rf"^{CUT}\s+UNREACHABLE ", out, re.M), out[-2000:]


def test_fleet_status_marks_the_stopped_job(planted):
    # Run after the tests above: <lab>-1 and -2 recovered (running or done), <lab>-3 still crashed.
    deadline = time.monotonic() + 60
    while True:
        rc, out = hsx("fleet-status", "--json")
        data = json.loads(out[out.index("{") :])
        hosts = {h["host"]: h for h in data["hosts"]}
        fine = [hosts[h]["mark"] is None for h in (PLAIN, VIA_HSX)]
        if all(fine) or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert set(hosts) == {PLAIN, VIA_HSX, CUT}
    assert all(fine), json.dumps(data, indent=1)[:3000]
    # The planted status says "running" for a process of another machine: pid_alive is unknown (null).
    assert hosts[CUT]["mark"] == "NOT PROGRESSING" and hosts[CUT]["reason"].startswith("state running")
    assert rc == 1
    assert data["total"]["done"] == sum(h["done"] for h in hosts.values())
    assert data["total"]["marked"] == {CUT: "NOT PROGRESSING"}
    rc_text, text = hsx("fleet-status")
    assert rc_text == 1 and re.search(rf"^{CUT} .*NOT PROGRESSING: state running", text, re.M)
    assert re.search(r"^FLEET: 3 hosts, done ", text, re.M), text[-3000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
