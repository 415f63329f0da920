"""Issue #39 done-when 1, 2 and the takeover benchmark; issue #40 scenario 2: one dataset over 3 real
lab hosts, and a host that dies for good taken over by the self-healing loop with no one at the keyboard.

The derived assignment (hsx_assignment_file, off in the lab's inventory, on here) splits a
dataset of SIZE samples in BUCKETS buckets over <lab>-1..3, each monitored (node_exporter, the job's
textfile metrics) and scraped by the self-healing stack on the control node (the real Prometheus,
Alertmanager and ansible-rulebook: selfheal_stack.py, its node-down window shortened to DOWN_FOR_S).
<lab>-3 is powered off for good mid-run (lab.py poweroff: every process killed at once, link down).
`hsx takeover --check` prints the plan and writes nothing; then the test only waits: HsxSelfHealNodeDown
fires, the rulebook runs playbooks/takeover.yml, which moves the dead host's buckets (unreachable: none
counts as finished) to the two live hosts, whose jobs resume with them; the fleet finishes and
`hsx fleet-status` says complete. <lab>-3 boots again and runs nothing; then fleet-status counts its
earlier shards as done twice, and the ids on the hosts' disks say the same: the live hosts hold the
dataset exactly once, <lab>-3's ids are all among them. Prints the benchmark: the takeover's start to
the first new shard on a taker (from the moment the assignment recorded it), and the power cut to it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from datetime import datetime

import pytest
import selfheal_stack as sh
from labctl import BIN, KEEPALIVE_SSH_ARGS, REPO, _lab_module, host, lab, lab_ssh, playbook, wait_for

from extraction.inputs.dataset import scan_dataset
from hsx.buckets import bucket_of, parse_assign
from hsx.index import decode_index_line

SIZE, BUCKETS = 192, 64
HOSTS = [host(i) for i in (1, 2, 3)]
DEAD = HOSTS[2]
OUTPUT = "/data/hsx/output"
DOWN_FOR_S = 40  # the lab's node-down window before the takeover (production 10 minutes)


def hsx(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", ANSIBLE_SSH_ARGS=KEEPALIVE_SSH_ARGS,
               ANSIBLE_INVENTORY=str(REPO / "inventory" / "lab"))  # hsx never defaults to the lab's
    return subprocess.run([str(BIN / "hsx"), *args], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=timeout)


def indexed_ids(name: str) -> list[str]:
    """The sample ids of a host's index (every good line; a quarantine tombstone is not written here)."""
    out = lab_ssh(name, f"cat {OUTPUT}/index.jsonl")
    assert out.returncode == 0, out.stderr
    records = [decode_index_line(line + b"\n") for line in out.stdout.encode().split(b"\n") if line]
    return [r["id"] for r in records if r and "id" in r]


def unit_state(name: str) -> tuple[str, str]:
    out = lab_ssh(name, "systemctl is-active hsx-extraction.service; systemctl is-enabled hsx-extraction.service")
    active, enabled = (out.stdout.split() + ["?", "?"])[:2]
    return active, enabled


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    work = tmp_path_factory.mktemp("fleet")
    fleet_vars = {"hsx_lab_dataset_size": SIZE, "hsx_buckets": BUCKETS,
                  "hsx_assignment_file": str(work / "fleet" / "assignment.json")}
    extra = [a for k, v in fleet_vars.items() for a in ("-e", f"{k}={v}")]
    lab("up", "3", "--data-size", "1G")
    running = None
    try:
        run = playbook("tests/plays/plant_model.yml", *extra)
        assert run.rc == 0, run.output[-3000:]
        run = playbook("tests/plays/deploy_monitored.yml", *extra)
        assert run.rc == 0, run.output[-3000:]
        # The loop's remedies read the lab's inventory and the fleet's settings, as host vars of a second
        # inventory source (group vars there would lose to the lab's group_vars/all).
        (work / "fleet-vars.yml").write_text(json.dumps({"all": {"hosts": {h: fleet_vars for h in HOSTS}}}))
        inventory = [str(REPO / "inventory" / "lab"), str(work / "fleet-vars.yml")]
        mod = _lab_module()
        running = sh.start(work, {h: mod.load_host(h).address for h in HOSTS}, inventory, work / "reports",
                           node_down_for_s=DOWN_FOR_S)
        yield work, extra, running
    finally:
        if running is not None:
            running.stop()
        lab("down", check=False)


def test_three_hosts_split_one_dataset_and_finish_it_without_a_dead_one(fleet):
    work, extra, running = fleet
    t_start = time.monotonic()
    assignment_file = work / "fleet" / "assignment.json"
    first = json.loads(assignment_file.read_text())
    assert sorted(first["hosts"]) == HOSTS and first["buckets"] == BUCKETS
    dead_buckets = parse_assign(first["hosts"][DEAD], BUCKETS)
    dataset = [e.sample_id for e in scan_dataset(REPO / ".cache" / "lab-assets" / f"tiny-{SIZE}.jsonl").entries]
    assert len(dataset) == len(set(dataset)) == SIZE
    for name in HOSTS:  # each job runs its own buckets, and is not started at boot (a fleet member)
        assert f"assign: {first['hosts'][name]}" in lab_ssh(name, "cat /etc/hsx/extract.yaml").stdout
        assert unit_state(name)[1] == "disabled"

    # Mid-run: the dead host has done some of its buckets, not all.
    wait_for(lambda: len(indexed_ids(DEAD)) >= 8, 300, f"{DEAD} to have shards")
    lab("poweroff", DEAD)
    t_off = time.time()

    report = ["--report-dir", str(work / "reports"), *extra]
    check = hsx("takeover", DEAD, "--check", *report)
    assert check.returncode == 0, check.stdout[-3000:]
    assert f"Plan: Would move {DEAD}'s unfinished buckets: {HOSTS[0]} takes " in check.stdout, check.stdout[-2000:]
    # (The window is longer than the check: the loop has not acted yet, what is in the file is the check's doing.)
    assert (sh.alert_state(running.prometheus, "HsxSelfHealNodeDown", DEAD) or {}).get("state") != "firing"
    assert json.loads(assignment_file.read_text()) == first, "--check must write nothing"

    # Now only the loop acts: the node-down alert, the rulebook, playbooks/takeover.yml.
    def first_new_shard() -> bool:
        return any(bucket_of(i, BUCKETS) in dead_buckets for name in HOSTS[:2] for i in indexed_ids(name))

    wait_for(first_new_shard, 400, f"a taking host's first shard of the dead host's buckets (rulebook log: {running.rulebook_log})", max_interval=1)
    t_shard = time.time()
    alert = sh.alert_state(running.prometheus, "HsxSelfHealNodeDown", DEAD)
    assert alert and alert["state"] == "firing", alert
    after = wait_for(lambda: (a := json.loads(assignment_file.read_text()))["epoch"] and a, 60, "the takeover's record")
    t_takeover = datetime.fromisoformat(after["history"][0]["at"]).timestamp()  # recorded: the jobs restart next
    assert after["epoch"] == 1 and after["retired"] == [DEAD] and after["hosts"][DEAD] == ""
    moved = set().union(*(parse_assign(r, BUCKETS) for r in after["history"][0]["moved"].values()))
    assert moved == dead_buckets  # unreachable: nothing counted finished, every bucket moves
    print(f"\nBENCHMARK takeover: the takeover recorded -> first new shard on a taking host: {t_shard - t_takeover:.0f} s"
          f" (1-s resolution); the power cut -> it: {t_shard - t_off:.1f} s (node-down window {DOWN_FOR_S} s, no human)")

    # The fleet finishes without the dead host; fleet-status says complete (exit 0).
    def complete() -> dict | None:
        r = hsx("fleet-status", "--json", "--assignment", str(assignment_file), "--report-dir", str(work / "reports"))
        view = json.loads(r.stdout)["dataset"] if r.stdout.startswith("{") else {}
        return (r.returncode, view) if view.get("complete") else None

    rc, view = wait_for(complete, 400, "the fleet to finish")
    assert rc == 0 and view["samples"]["missing"] == 0 and view["bucket_states"]["done"] == BUCKETS

    # The dead host comes back: its job does not start (not enabled at boot), it writes nothing.
    lab("boot", DEAD)
    dead_ids = wait_for(lambda: indexed_ids(DEAD) or None, 120, f"{DEAD} to answer after its boot")
    time.sleep(5)
    assert unit_state(DEAD) == ("inactive", "disabled")
    assert indexed_ids(DEAD) == dead_ids

    # The ids on the disks: the live hosts hold the dataset exactly once; the dead host's are
    # all in its old buckets and all among the live hosts' (done twice, and counted so).
    live = [indexed_ids(name) for name in HOSTS[:2]]
    assert sorted(live[0] + live[1]) == sorted(dataset)
    assert {bucket_of(i, BUCKETS) for i in dead_ids} <= dead_buckets and set(dead_ids) <= set(dataset)
    r = hsx("fleet-status", "--assignment", str(assignment_file), "--report-dir", str(work / "reports"))
    assert r.returncode == 0, r.stdout[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("DATASET:")][0]
    assert f"samples {SIZE}/{SIZE} done ({SIZE - len(dead_ids)} once, {len(dead_ids)} twice), 0 missing" in line
    assert line.endswith("COMPLETE") and "(retired)" in r.stdout
    print(r.stdout)
    # One takeover, by the loop: the rulebook's window throttles the alert's re-posts.
    assert json.loads(assignment_file.read_text())["epoch"] == 1
    print(f"test_fleet: {time.monotonic() - t_start:.0f} s after the fixture")
