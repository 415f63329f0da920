"""The extraction job unit on a real lab host: deployed from the wheelhouse with no network,
killed mid-run (systemd restarts it and it resumes), paused for lack of disk (it stays stopped
and says why)."""

from __future__ import annotations

import json
import time

import pytest
from labctl import host, lab, lab_ssh, playbook

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


def use_output(path: str, dataset: str | None = None) -> None:
    """Point the deployed job at a fresh output (and dataset) and restart it (a new run, from sample 0)."""
    edit = f"s#^output: .*#output: {path}#" + (f"; s#^dataset: .*#dataset: {dataset}#" if dataset else "")
    lab_ssh(HOST, f"sed -i '{edit}' /etc/hsx/extract.yaml && systemctl restart hsx-extraction")


def status(output: str = "/data/hsx/output") -> dict:
    out = lab_ssh(HOST, f"/opt/hsx/venv/bin/hsx status {output} --json").stdout
    outputs = json.loads(out).get("outputs") if out.strip().startswith("{") else None
    return outputs[0] if outputs else {}


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


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
    wait_for(lambda: 16 <= (status(out).get("done") or 0) < n - 200, 300, "the job to be mid-run")
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
    lab_ssh(HOST, "fallocate -l $(( $(df --output=avail -B1 /data | tail -1) - 8*1024*1024 )) /data/filler")
    use_output("/data/hsx/run-paused")
    wait_for(lambda: lab_ssh(HOST, "systemctl is-active hsx-extraction").stdout.strip() in ("failed", "inactive"),
             120, "the paused job to stop")
    time.sleep(5)  # longer than RestartSec: a restart would have happened by now
    exit_status = lab_ssh(HOST, "systemctl show -p ExecMainStatus --value hsx-extraction").stdout.strip()
    assert exit_status == str(EXIT_PAUSED), exit_status
    journal = lab_ssh(HOST, "systemctl status hsx-extraction --no-pager -n 20").stdout
    assert "PAUSED (exit 75: disk low). Needs a person" in journal, journal
    assert lab_ssh(HOST, "systemctl is-active hsx-extraction").stdout.strip() != "active"
