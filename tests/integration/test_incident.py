"""The incident, reproduced on 4 real lab hosts and recovered three ways, as an operator would at 3 a.m.

`ansible-playbook recover.yml` from an unprivileged account on the control node, with sudo on the
targets only (issue #39 item 5; tests/control_node_account.py): everything the play does there - the
wheelhouse build from the account's checkout, the reports - is that account's, and nothing under its
home is owned by root afterwards. `hsx recover` (root's checkout), whose report must agree with the
playbook's. `recover.yml --check`, the assessment, which changes nothing.

<lab>-1 (GOOD), <lab>-3 (VIA_HSX), <lab>-4 (CUT): an auto-started fake vLLM unit, a half-finished
tiny-model extraction (128 of 256) with truncated and corrupt shards, orphan temps, a dead "running"
status, nothing deployed (tests/plays/plant_incident.yml). <lab>-2 (BROKEN): the same, but its /data is
not mounted (broken beyond repair: the play must report it and go on with the others).
GOOD and BROKEN: the operator's recover.yml. VIA_HSX: --check first, then `hsx recover`. CUT: `hsx
recover` while its link is cut mid-run (unreachable, exit 1), so its crashed job stays stopped; then
`hsx fleet-status` marks CUT only.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time

import pytest
import torch
from control_node_account import operator_account
from labctl import BIN, KEEPALIVE_SSH_ARGS, REPO, lab, lab_fetch, lab_ssh, playbook
from labctl import host as lab_host

from hsx.index import load_index

# One GOOD host: a second recovered the same way cost ~90 CPU-s of make test and showed nothing more
# (the first run still plays two hosts, GOOD and BROKEN, and the fleet-status three).
GOOD = [lab_host(1)]
BROKEN = lab_host(2)
VIA_HSX, CUT = lab_host(3), lab_host(4)
ASSETS = REPO / ".cache" / "lab-assets"


@pytest.fixture(scope="module")
def operator():
    with operator_account() as account:
        yield account


@pytest.fixture(scope="module")
def fleet(operator):
    lab("up", "4", "--data-size", "1G", "--no-data", BROKEN)
    try:
        planted = playbook("tests/plays/plant_incident.yml")  # the crash: root's doing, not the operator's
        assert planted.rc == 0, planted.output[-3000:]
        t0 = time.monotonic()
        first = operator.playbook("recover.yml", "--limit", ",".join([*GOOD, BROKEN]))
        first.seconds = time.monotonic() - t0
        yield first
    finally:
        lab("down", check=False)


def hsx(*args: str, on_line=None, timeout: int = 900) -> tuple[int, str]:
    """Run `hsx ...` (not a terminal: line-by-line progress); `on_line` sees each line as it comes."""
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", ANSIBLE_SSH_ARGS=KEEPALIVE_SSH_ARGS,
               ANSIBLE_INVENTORY=str(REPO / "inventory" / "lab"))  # hsx never defaults to the lab's
    proc = subprocess.Popen([str(BIN / "hsx"), *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
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


def wait_done(host: str, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = lab_ssh(host, "/opt/hsx/venv/bin/hsx status /data/hsx/output --json").stdout
        status = json.loads(out)["outputs"][0] if out.strip().startswith("{") else {}
        if status.get("state") == "done":
            return status
        time.sleep(3)
    raise AssertionError(f"{host}: extraction not done after {timeout}s: {status}")


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


def host_part(summary: str, host: str) -> str:
    """A host's row of summary.md's table and its section of checks, its name and the numbers that
    move masked, and whether the tiny job was still running (mask_job_state)."""
    row = next(line for line in summary.splitlines() if line.startswith(f"| {host} |"))
    section = summary.split(f"### {host}\n", 1)[1].split("\n### ", 1)[0]
    return mask_job_state(re.sub(r"\d+(?:\.\d+)?", "N", f"{row}\n{section}".replace(host, "HOST")))


def operator_report(operator, run: int = 0) -> tuple[dict, str]:
    """The reports (per host) and summary.md of the operator's `run`-th recover.yml."""
    report_dir = sorted(operator.reports.iterdir())[run]
    hosts = {h: json.loads((report_dir / f"{h}.json").read_text()) for h in [*GOOD, BROKEN]}
    return hosts, (report_dir / "summary.md").read_text()


def test_first_run_recovers_the_good_hosts_and_reports_the_broken_one(fleet, operator):
    recap = fleet.recap()
    assert fleet.rc != 0, "a failed host must make the play fail"
    for host in GOOD:
        assert recap[host]["failed"] == 0, fleet.output[-4000:]
    assert recap[BROKEN]["failed"] == 1
    assert VIA_HSX not in recap and CUT not in recap, "--limit"
    reports, summary = operator_report(operator)
    for host in GOOD:
        r = reports[host]
        assert r["ok"], r
        checks = {c["name"]: c for c in r["checks"]}
        assert "vllm-kimi-k25-int4.service" in checks["gpus"]["detail"]
        assert "3 bad" in checks["shards"]["detail"] and "3 quarantined" in checks["shards"]["detail"]
        assert "2 temp files removed" in checks["shards"]["detail"]
        assert r["before"]["progress"]["done"] == 128 and r["before"]["progress"]["total"] == 256
    broken = reports[BROKEN]
    assert not broken["ok"] and broken["failed_step"] == "storage"
    assert f"/data is not mounted on {BROKEN}" in broken["reason"]
    assert "1 of 2 hosts ok." in summary and f"**{BROKEN}**: step `storage`" in summary
    for host in GOOD:  # the fake vLLM unit is stopped and disabled, the unrelated one untouched
        states = lab_ssh(host, "systemctl is-active vllm-kimi-k25-int4 node-telemetry; "
                               "systemctl is-enabled vllm-kimi-k25-int4").stdout.split()
        assert states == ["inactive", "active", "disabled"], (host, states)


def test_check_mode_assesses_and_changes_nothing(fleet):
    """On VIA_HSX, before `hsx recover` (not on CUT: the ssh master this run leaves would notice the cut
    only after ansible.cfg's minute of keepalives, not the seconds KEEPALIVE_SSH_ARGS gives hsx recover)."""
    run = playbook("recover.yml", "--check", "--diff", "--limit", VIA_HSX)
    assert run.rc == 0, run.output[-3000:]
    assert run.recap()[VIA_HSX]["failed"] == 0
    report = run.output[run.output.index("units_running"):]
    assert "vllm-kimi-k25-int4.service" in report.split("\n", 3)[1], report[:400]
    assert "fstype: ext4" in run.output
    # --check reports what it would change (changed > 0) but the host is exactly as it was:
    still = lab_ssh(VIA_HSX, "systemctl is-active vllm-kimi-k25-int4.service node-telemetry.service; "
                         "systemctl is-enabled vllm-kimi-k25-int4.service; ls /opt/hsx /etc/hsx 2>&1 | head -2")
    assert still.stdout.split()[:3] == ["active", "active", "enabled"], still.stdout
    assert "No such file or directory" in still.stdout, still.stdout


def test_hsx_recover_matches_the_playbook(fleet, operator, tmp_path):
    """`hsx recover` of an identically planted host: the same report, summary part and counts as the
    operator's recover.yml gave GOOD[0] (the first host: run_once tasks count for it, as for VIA_HSX)."""
    rc, out = hsx("recover", "--limit", VIA_HSX, "--report-dir", str(tmp_path))
    assert rc == 0, out[-3000:]
    assert f"{VIA_HSX}: stage shard_verify" in out and f"{VIA_HSX}: changed: " in out
    assert re.search(rf"^{VIA_HSX}\s+ok\s+ok=\d+ changed=\d+ failed=0", out, re.M), out[-2000:]
    plain, plain_summary = operator_report(operator)
    (hsx_dir,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    mine = json.loads((hsx_dir / f"{VIA_HSX}.json").read_text())
    assert mine["ok"] and essentials(mine, VIA_HSX) == essentials(plain[GOOD[0]], GOOD[0])
    assert "3 quarantined" in dict((c["name"], c["detail"]) for c in mine["checks"])["shards"]
    summary = (hsx_dir / "summary.md").read_text()
    assert summary in out, "hsx recover must print the playbook's summary"
    assert host_part(summary, VIA_HSX) == host_part(plain_summary, GOOD[0])
    # Same counts, but for the control node's wheelhouse build: the operator's first run always builds
    # (its fresh checkout); root's counts as changed only where the sources changed since make test built it.
    plain_build = bool(re.search(r"Build the wheelhouse on the control node\] \**\nchanged:", fleet.output))
    hsx_build = bool(re.search(rf"^{VIA_HSX}: changed: .*Build the wheelhouse on the control node", out, re.M))
    counts = re.search(rf"^{VIA_HSX}\s+ok\s+ok=(\d+) changed=(\d+) failed=0", out, re.M)
    recap = fleet.recap()[GOOD[0]]
    assert int(counts[1]) == recap["ok"], out[-2000:]
    assert int(counts[2]) - hsx_build == recap["changed"] - plain_build, (out[-2000:], fleet.output[-2000:])
    artifacts = list((tmp_path / ".runner" / "artifacts").iterdir())
    command = json.loads((artifacts[0] / "command").read_text())
    assert "env" not in command and not (tmp_path / ".runner" / "env").exists()


def test_a_host_cut_off_mid_run_is_unreachable_exit_1(fleet, tmp_path):
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


def test_fleet_status_marks_the_stopped_job(fleet):
    # After the tests above: GOOD and VIA_HSX recovered (running or done), CUT still crashed.
    limit = ["--limit", ",".join([*GOOD, VIA_HSX, CUT])]
    watched = [*GOOD, VIA_HSX]
    deadline = time.monotonic() + 60
    while True:
        rc, out = hsx("fleet-status", "--json", *limit)
        data = json.loads(out[out.index("{") :])
        hosts = {h["host"]: h for h in data["hosts"]}
        fine = [hosts[h]["mark"] is None for h in watched]
        if all(fine) or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert set(hosts) == {*watched, CUT}
    assert all(fine), json.dumps(data, indent=1)[:3000]
    # The planted status says "running" for a process of another machine: pid_alive is unknown (null).
    assert hosts[CUT]["mark"] == "NOT PROGRESSING" and hosts[CUT]["reason"].startswith("state running")
    assert rc == 1
    assert data["total"]["done"] == sum(h["done"] for h in hosts.values())
    assert data["total"]["marked"] == {CUT: "NOT PROGRESSING"}
    rc_text, text = hsx("fleet-status", *limit)
    assert rc_text == 1 and re.search(rf"^{CUT} .*NOT PROGRESSING: state running", text, re.M)
    assert re.search(r"^FLEET: 3 hosts, done ", text, re.M), text[-3000:]


def test_recovered_shards_pass_deep_and_equal_a_clean_run(fleet, tmp_path):
    for host in GOOD:
        status = wait_done(host)
        assert status["done"] == 256 and status["skipped_existing"] == 125
        deep = lab_ssh(host, "/opt/hsx/venv/bin/hsx verify /data/hsx/output --level deep --json")
        assert deep.returncode == 0, deep.stdout[-2000:]
        assert json.loads(deep.stdout)["ok"] == 256
    # One host's shards, fetched back, against an uninterrupted run of the same model and options.
    clean = ASSETS / "clean-256"
    if not (clean / "status.json").exists():
        h = {"layers": "1,3,4", "dtype": "fp32", "max_length": "512", "batch_size": "8"}  # the lab's options
        subprocess.run([str(REPO / ".venv/bin/hsx"), "extract", "--model", str(ASSETS / "tiny-dsv3"),
                        "--dataset", str(ASSETS / "tiny-256.jsonl"), "--output", str(clean), "--layers", h["layers"],
                        "--dtype", h["dtype"], "--max-length", h["max_length"], "--batch-size", h["batch_size"],
                        "--reserve-bytes", "16M", "--progress", "off"], check=True, capture_output=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))  # beside the lab's jobs (inventory/lab)
    got = tmp_path / "got"
    lab_fetch(GOOD[0], "/data/hsx/output", got, "shards", "index.jsonl")

    mine, ref = load_index(str(got)), load_index(str(clean))
    assert set(mine) == set(ref) and len(mine) == 256
    for sample_id, entry in ref.items():
        a = torch.load(got / mine[sample_id].path, weights_only=True)
        b = torch.load(clean / entry.path, weights_only=True)
        assert a.keys() == b.keys()
        for key in b:
            assert torch.equal(a[key], b[key]), (sample_id, key)


def test_second_run_changes_nothing_and_keeps_the_jobs(fleet, operator):
    before = {h: lab_ssh(h, "systemctl show -p InvocationID --value hsx-extraction").stdout.strip() for h in GOOD}
    second = operator.playbook("recover.yml", "--limit", ",".join([*GOOD, BROKEN]))
    recap = second.recap()
    for host in GOOD:
        assert recap[host]["changed"] == 0 and recap[host]["failed"] == 0, second.output[-4000:]
        after = lab_ssh(host, "systemctl show -p InvocationID --value hsx-extraction").stdout.strip()
        assert after == before[host], f"{host}: the job was restarted"
    assert recap[BROKEN]["failed"] == 1


def test_nothing_the_operator_ran_left_a_root_owned_file(fleet, operator):
    """After both runs (the wheelhouse built from its checkout, two reports written): no sudo was
    asked on the control node, so nothing under the account's home is root's."""
    assert len(list(operator.reports.iterdir())) == 2
    manifest = operator.checkout / ".cache" / "wheelhouse" / "wheelhouse.json"
    assert "source_digest" in json.loads(manifest.read_text()), "the account's build stage did not build"
    owned = operator.owned_by_root()
    assert not owned, owned[:20]
