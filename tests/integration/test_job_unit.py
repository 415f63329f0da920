"""The extraction job unit on a real lab host: deployed from the wheelhouse with no network,
killed mid-run (systemd restarts it and it resumes), paused for lack of disk (it stays stopped
and says why) - all under the hardened unit (issue #30 item 11): the job runs as the `hsx` account in
its sandbox, which writes only OUTPUT, and takes over an OUTPUT root wrote without following links."""

from __future__ import annotations

import json
import time

import pytest
from labctl import host, lab, lab_ssh, playbook, wait_for

from hsx.exitcodes import EXIT_PAUSED

HOST = host(1)
FAST_RESTART = ["-e", "extraction_job_restart_sec=2", "-e", "extraction_job_wait_for_progress=false"]


@pytest.fixture(scope="module")
def deployed():
    lab("up", "1", "--data-size", "1G")
    planted = playbook("tests/plays/plant_model.yml")
    assert planted.rc == 0, planted.output[-3000:]
    first = playbook("tests/plays/deploy_and_run.yml", *FAST_RESTART)
    assert first.rc == 0, first.output[-4000:]
    yield first
    lab("down", check=False)


def use_output(path: str, dataset: str | None = None, start: bool = True) -> None:
    """Point the deployed job at another output (and dataset) through the roles, as an operator would:
    the hardened unit may write only its OUTPUT (ReadWritePaths), which the role makes and gives to the
    job's account; then restart it (a new run, from sample 0)."""
    extra = ["-e", f"hsx_output_dir={path}", "-e", "extraction_job_start=false"]
    extra += ["-e", f"hsx_dataset_path={dataset}"] if dataset else []
    moved = playbook("tests/plays/deploy_and_run.yml", *FAST_RESTART, *extra)
    assert moved.rc == 0, moved.output[-3000:]
    if start:
        lab_ssh(HOST, "systemctl restart hsx-extraction")


def status(output: str = "/data/hsx/output") -> dict:
    out = lab_ssh(HOST, f"/opt/hsx/venv/bin/hsx status {output} --json").stdout
    outputs = json.loads(out).get("outputs") if out.strip().startswith("{") else None
    return outputs[0] if outputs else {}


def test_deployed_without_network_and_idempotent(deployed):
    assert lab_ssh(HOST, "/opt/hsx/venv/bin/hsx --version").stdout.strip().startswith("hsx ")
    assert lab_ssh(HOST, "python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 443), 2)'").returncode != 0
    again = playbook("tests/plays/deploy_and_run.yml", *FAST_RESTART)
    assert again.rc == 0 and again.recap()[HOST]["changed"] == 0, again.output[-3000:]


def test_killed_job_is_restarted_and_resumes(deployed):
    out, n = "/data/hsx/run-killed", 1000
    # The lab's 256 samples take ~3 s now, one status update (every 3 s) from 0 to done: a run long
    # enough to be caught mid-way (~12 s, ~320 MB of the 1 GB /data).
    big = f"/data/datasets/tiny-{n}.jsonl"
    lab_ssh(HOST, f"test -e {big} || /opt/hsx/venv/bin/hsx tiny-dataset {big} -n {n}")
    use_output(out, big)
    wait_for(lambda: 16 <= (status(out).get("done") or 0) < n - 200, 300, "the job to be mid-run", max_interval=1)
    pid = lab_ssh(HOST, "systemctl show -p MainPID --value hsx-extraction").stdout.strip()
    lab_ssh(HOST, f"kill -9 {pid}")
    restarted = wait_for(lambda: (s := status(out)).get("pid") not in (None, int(pid)) and s, 120, "a restart")
    assert restarted["skipped_existing"] > 0
    assert lab_ssh(HOST, "systemctl show -p NRestarts --value hsx-extraction").stdout.strip() != "0"
    done = wait_for(lambda: (s := status(out)).get("state") == "done" and s, 600, "the job to finish")
    assert done["done"] == done["total"]
    deep = lab_ssh(HOST, f"/opt/hsx/venv/bin/hsx verify {out} --level deep --json")
    assert deep.returncode == 0 and json.loads(deep.stdout)["ok"] == done["total"]


def test_job_paused_for_disk_stays_stopped_and_says_why(deployed):
    # A new run into a fresh output on a nearly full /data: the runner pauses with exit 75.
    use_output("/data/hsx/run-paused", start=False)
    lab_ssh(HOST, "fallocate -l $(( $(df --output=avail -B1 /data | tail -1) - 8*1024*1024 )) /data/filler")
    lab_ssh(HOST, "systemctl restart hsx-extraction")
    wait_for(lambda: lab_ssh(HOST, "systemctl is-active hsx-extraction").stdout.strip() in ("failed", "inactive"),
             120, "the paused job to stop")
    time.sleep(5)  # longer than RestartSec: a restart would have happened by now
    exit_status = lab_ssh(HOST, "systemctl show -p ExecMainStatus --value hsx-extraction").stdout.strip()
    assert exit_status == str(EXIT_PAUSED), exit_status
    journal = lab_ssh(HOST, "systemctl status hsx-extraction --no-pager -n 20").stdout
    assert "PAUSED (exit 75: disk low). Needs a person" in journal, journal
    assert lab_ssh(HOST, "systemctl is-active hsx-extraction").stdout.strip() != "active"
    lab_ssh(HOST, "rm -f /data/filler")


def test_job_runs_unprivileged_in_a_sandbox_that_writes_only_output(deployed):
    """#30 item 11: the job's account, not root; output not readable by others; the sandbox as
    systemd applied it (and its exposure score); a write outside OUTPUT fails inside the job's own
    mount namespace while OUTPUT stays writable."""
    show = lab_ssh(HOST, "systemctl show -p User -p NoNewPrivileges -p ProtectSystem -p ProtectHome "
                         "-p PrivateTmp -p PrivateDevices -p RestrictSUIDSGID -p ReadWritePaths hsx-extraction").stdout
    props = dict(line.split("=", 1) for line in show.strip().splitlines())
    assert props["User"] == "hsx" and props["NoNewPrivileges"] == "yes" and props["ProtectSystem"] == "strict", props
    assert props["ProtectHome"] == "yes" and props["PrivateDevices"] == "yes" and props["RestrictSUIDSGID"] == "yes"
    out = "/data/hsx/output"
    assert lab_ssh(HOST, f"stat -c %U:%G {out} {out}/index.jsonl").stdout.split() == ["hsx:hsx", "hsx:hsx"]
    # input_ids reveal the dataset: no shard, index line or directory readable by others (the
    # metrics file is node-exporter's to read and holds only counts).
    leaks = lab_ssh(HOST, f"find {out} -perm /o=rwx ! -name '*.prom'").stdout.split()
    assert leaks == [], leaks
    security = lab_ssh(HOST, "systemd-analyze security --no-pager hsx-extraction.service").stdout
    score = float(security.rsplit("Overall exposure level for hsx-extraction.service:", 1)[1].split()[0])
    print(f"systemd-analyze security hsx-extraction.service: {score}")
    assert score <= 2.5, security[-3000:]
    running = "/data/hsx/run-sandbox"
    use_output(running, "/data/datasets/tiny-1000.jsonl")  # a run long enough to look inside
    pid = wait_for(lambda: (p := lab_ssh(HOST, "systemctl show -p MainPID --value hsx-extraction").stdout.strip())
                   not in ("", "0") and p, 60, "the job to run")
    probe = f"nsenter -t {pid} -m -- setpriv --reuid=hsx --regid=hsx --clear-groups"
    denied = lab_ssh(HOST, f"{probe} touch /data/hsx/outside-probe")
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr, denied
    allowed = lab_ssh(HOST, f"{probe} touch {running}/.probe && {probe} rm -f {running}/.probe")
    assert allowed.returncode == 0, allowed.stderr
    lab_ssh(HOST, "systemctl stop hsx-extraction")


def test_a_root_owned_output_is_taken_over_without_following_links(deployed):
    """An OUTPUT an older release wrote as root (a node recovered from the old layout): the role gives
    it to the job's account without following the links planted in it, and the job finishes it."""
    legacy = "/data/hsx/legacy"
    lab_ssh(HOST, f"rm -rf {legacy} && install -d -m 0755 {legacy}/shards && echo secret > /data/root-file && "
                  f"chmod 0644 /data/root-file && ln -s /data/root-file {legacy}/shards/planted.pt && "
                  f"ln /data/root-file {legacy}/hard-link && echo x > {legacy}/notes && chmod 0644 {legacy}/notes")
    use_output(legacy)
    owners = lab_ssh(HOST, f"stat -c '%n %U %a' {legacy} {legacy}/notes /data/root-file {legacy}/hard-link").stdout
    assert owners.split("\n")[:4] == [f"{legacy} hsx 750", f"{legacy}/notes hsx 640", "/data/root-file root 644",
                                      f"{legacy}/hard-link root 644"], owners
    # The hardened job writes into the tree it was given (a run, not just a start).
    wait_for(lambda: (status(legacy).get("done") or 0) >= 16, 300, "the job to publish into the taken-over output")
    lab_ssh(HOST, "systemctl stop hsx-extraction")
