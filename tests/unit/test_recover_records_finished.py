"""Issue #51 item 7: a recovery records what each node reported finished, beside the fleet's assignment.

recover.yml's deploy stage runs roles/extraction_job's `assignment` entry point with
extraction_job_record_finished on: every node's output is read and what each reports finished goes to
`.fleet/finished.json` through module hsx_assignment's `reported` (the takeover's and the rebalance's
path; hsx fleet-status writes the same record), so a later takeover of a node that no longer answers
parks those buckets instead of redoing them. Here that entry point alone runs on local stand-in hosts:
n1 finished one of its buckets, n2 none, n3's index cannot be read (a link: its entry stays as
recorded). --check writes nothing and says what would be recorded. Without an assignment file
(hsx_assignment_file: '', the lab's default inventory) nothing is read or recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_takeover_play import flat, plant_output

from hsx.buckets import bucket_of

ROOT = Path(__file__).resolve().parents[2]
IDS = [f"s{i}" for i in range(40)]
FLEET = {"buckets": 6, "created": "x", "epoch": 0, "hosts": {"n1": "0-1", "n2": "2-3", "n3": "4-5"},
         "retired": [], "history": []}
EARLIER = {"version": 1, "buckets": 6, "hosts": {
    "n1": {"finished": "", "at": "2026-12-07T09:00:00+00:00", "by": "fleet-status"},
    "n3": {"finished": "4", "at": "2026-12-07T10:00:00+00:00", "by": "fleet-status"}}}


def assignment_step(tmp: Path, *args: str, assignment_file: str | None = None) -> subprocess.CompletedProcess:
    """The `assignment` entry point as recover.yml runs it (extraction_job_record_finished on), alone."""
    py = sys.executable
    hosts = {h: {"ansible_connection": "local", "ansible_python_interpreter": py, "hsx_output_dir": str(tmp / h)}
             for h in ("n1", "n2", "n3")}
    where = str(tmp / ".fleet" / "assignment.json") if assignment_file is None else assignment_file
    inventory = {"all": {"hosts": hosts, "vars": {"hsx_assignment_file": where, "hsx_buckets": 6,
                                                  "hsx_job_unit": "hsx-test-no-such-unit.service"}}}
    (tmp / "inventory.json").write_text(json.dumps(inventory))
    tasks = [{"ansible.builtin.include_role": {"name": "extraction_job", "tasks_from": "assignment"}}]
    play = [{"hosts": "all", "gather_facts": False, "become": False, "tasks": tasks,
             "vars": {"extraction_job_record_finished": True}}]
    (tmp / "play.yml").write_text(json.dumps(play))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    return subprocess.run([str(Path(py).parent / "ansible-playbook"), "-i", str(tmp / "inventory.json"),
                           str(tmp / "play.yml"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_a_recovery_records_what_each_node_reported_finished_and_check_mode_writes_nothing(tmp_path) -> None:
    fleet_dir = tmp_path / ".fleet"
    fleet_dir.mkdir()
    (fleet_dir / "assignment.json").write_text(json.dumps(FLEET))
    record = fleet_dir / "finished.json"
    record.write_text(json.dumps(EARLIER))
    before = record.read_bytes()
    in_bucket = {b: [i for i in IDS if bucket_of(i, 6) == b] for b in range(6)}
    plant_output(tmp_path / "n1", "0-1", in_bucket[0])  # bucket 0 whole: finished
    plant_output(tmp_path / "n2", "2-3", in_bucket[2][:1])  # bucket 2 in part: nothing finished
    plant_output(tmp_path / "n3", "4-5", in_bucket[4])
    (tmp_path / "n3" / "index.jsonl").rename(tmp_path / "n3" / "index.real")  # a link: never followed, unread
    (tmp_path / "n3" / "index.jsonl").symlink_to(tmp_path / "n3" / "index.real")

    check = assignment_step(tmp_path, "--check")
    assert check.returncode == 0, check.stdout[-4000:]
    assert (f"Would record in {record} what each node read reported finished: n1 0; n2 nothing "
            "(check mode: nothing written).") in flat(check.stdout), check.stdout[-4000:]
    assert record.read_bytes() == before

    done = assignment_step(tmp_path)
    assert done.returncode == 0, done.stdout[-4000:]
    assert f"Recorded in {record} what each node read reported finished: n1 0; n2 nothing." in flat(done.stdout)
    hosts = json.loads(record.read_text())["hosts"]
    assert {h: (e["finished"], e["by"]) for h, e in hosts.items()} == {
        "n1": ("0", "recovery"), "n2": ("", "recovery"), "n3": ("4", "fleet-status")}
    assert hosts["n3"] == EARLIER["hosts"]["n3"]  # unread: as recorded
    assert json.loads((fleet_dir / "assignment.json").read_text()) == FLEET  # the assignment is only read


def test_without_an_assignment_file_nothing_is_read_or_recorded(tmp_path) -> None:
    plant_output(tmp_path / "n1", "0-1", [])
    proc = assignment_step(tmp_path, assignment_file="")
    assert proc.returncode == 0, proc.stdout[-4000:]
    out = flat(proc.stdout)
    assert "Read which buckets every node has started and finished" in out
    assert "ok: [n1]" not in out.split("TASK [extraction_job : Read which buckets")[1].split("TASK [")[0]
    assert "reported finished:" not in out and not list(tmp_path.rglob("finished.json"))


def test_a_record_it_cannot_believe_is_a_warning_for_a_recovery_not_a_failure(tmp_path) -> None:
    """A recovery only adds to the record: a damaged finished.json must not stop the node coming back (the
    whole fleet's recoveries would fail at once); it is left as it is, for a takeover to refuse."""
    fleet_dir = tmp_path / ".fleet"
    fleet_dir.mkdir()
    (fleet_dir / "assignment.json").write_text(json.dumps(FLEET))
    record = fleet_dir / "finished.json"
    record.write_text('{"version": 1, "buckets": 6, "hosts": ')  # cut short
    for h, spec in (("n1", "0-1"), ("n2", "2-3"), ("n3", "4-5")):
        plant_output(tmp_path / h, spec, [])
    done = assignment_step(tmp_path)
    assert done.returncode == 0, done.stdout[-4000:]
    assert "nothing recorded; the recovery goes on" in flat(done.stdout + done.stderr), done.stdout[-3000:]
    assert record.read_text() == '{"version": 1, "buckets": 6, "hosts": '
