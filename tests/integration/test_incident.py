"""The incident, reproduced on a fleet of 3 real lab hosts, recovered by `ansible-playbook recover.yml`
run as an operator would run it at 3 a.m.: from an unprivileged account on the control node, with sudo
on the targets only (issue #39 item 5; tests/control_node_account.py). Everything the play does there -
the wheelhouse build from the account's checkout, the reports - is that account's: nothing under its
home is owned by root afterwards.

hsxlab-1..2: an auto-started fake vLLM unit, a half-finished tiny-model extraction (128 of 256)
with truncated and corrupt shards, orphan temps, a dead "running" status, nothing deployed.
hsxlab-3: the same, but its /data is not mounted (broken beyond repair: the play must report it
and go on with the others).
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import torch
from control_node_account import operator_account
from labctl import REPO, lab, lab_fetch, lab_ssh, playbook
from labctl import host as lab_host

from hsx.index import load_index

GOOD = [lab_host(1), lab_host(2)]  # two are a fleet here: test_fleet and test_hsx_recover run three
BROKEN = lab_host(3)
ASSETS = REPO / ".cache" / "lab-assets"


@pytest.fixture(scope="module")
def operator():
    with operator_account() as account:
        yield account


@pytest.fixture(scope="module")
def fleet(operator):
    lab("up", "3", "--data-size", "1G", "--no-data", BROKEN)
    try:
        planted = playbook("tests/plays/plant_incident.yml")  # the crash: root's doing, not the operator's
        assert planted.rc == 0, planted.output[-3000:]
        t0 = time.monotonic()
        first = operator.playbook("recover.yml")
        first.seconds = time.monotonic() - t0
        yield first
    finally:
        lab("down", check=False)


def wait_done(host: str, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = lab_ssh(host, "/opt/hsx/venv/bin/hsx status /data/hsx/output --json").stdout
        status = json.loads(out)["outputs"][0] if out.strip().startswith("{") else {}
        if status.get("state") == "done":
            return status
        time.sleep(3)
    raise AssertionError(f"{host}: extraction not done after {timeout}s: {status}")


def test_first_run_recovers_the_good_hosts_and_reports_the_broken_one(fleet, operator):
    recap = fleet.recap()
    assert fleet.rc != 0, "a failed host must make the play fail"
    for host in GOOD:
        assert recap[host]["failed"] == 0, fleet.output[-4000:]
    assert recap[BROKEN]["failed"] == 1
    (report_dir,) = operator.reports.iterdir()
    reports = {h: json.loads((report_dir / f"{h}.json").read_text()) for h in [*GOOD, BROKEN]}
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
    summary = (report_dir / "summary.md").read_text()
    assert "2 of 3 hosts ok." in summary and f"**{BROKEN}**: step `storage`" in summary
    for host in GOOD:  # the fake vLLM unit is stopped and disabled, the unrelated one untouched
        states = lab_ssh(host, "systemctl is-active vllm-kimi-k25-int4 node-telemetry; "
                               "systemctl is-enabled vllm-kimi-k25-int4").stdout.split()
        assert states == ["inactive", "active", "disabled"], (host, states)


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
    second = operator.playbook("recover.yml")
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
