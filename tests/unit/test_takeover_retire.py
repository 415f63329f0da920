"""Issue #51 items 5 and 7: a retired (taken-over) host runs nothing, and says so.

- A takeover re-run for a retired host that answers again (a healed partition: its job ran on)
  stops its job and keeps it from starting at boot, and its metrics say it is retired
  (hsx_fleet_retired 1 in hsx-fleet.prom, node_exporter's textfile directory); a second run changes
  nothing. Every takeover writes a report, as a recovery does.
- recover.yml renders no bucket for a retired host, even one that kept finished buckets: its job
  is stopped, never started, its config left as it was (the README's promise; before, it was
  started with its kept buckets).
- A host renamed or removed from the inventory can still be taken over by its name in the file.

systemd is not PID 1 on this machine: the unit is the stand-in tests/fakes/systemctl (the lab's real
hosts run the whole takeover: tests/integration/test_fleet.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from test_fleet_split_role import config, play
from test_takeover_play import flat, plant_output

ROOT = Path(__file__).resolve().parents[2]
FAKE_SYSTEMCTL = ROOT / "tests" / "fakes" / "systemctl"
UNIT = "hsx-test-extraction.service"


def takeover(tmp: Path, dead: str, hosts: dict[str, dict], *args: str) -> subprocess.CompletedProcess:
    """playbooks/takeover.yml on local stand-in hosts, their unit the fake systemctl's."""
    py = sys.executable
    inventory = {"extraction_nodes": {"hosts": hosts, "vars": {
        "ansible_connection": "local", "ansible_python_interpreter": py,
        "hsx_assignment_file": str(tmp / "fleet.json"), "hsx_become": False, "hsx_model_path": "/m",
        "hsx_dataset_path": "/d.jsonl", "hsx_job_unit": UNIT}}}
    (tmp / "inventory.json").write_text(json.dumps(inventory))
    (tmp / "systemd").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1", ANSIBLE_TIMEOUT="5",
               PATH=f"{FAKE_SYSTEMCTL}:{env['PATH']}", HSX_FAKE_SYSTEMCTL_DIR=str(tmp / "systemd"))
    return subprocess.run([str(Path(py).parent / "ansible-playbook"), "-i", str(tmp / "inventory.json"),
                           "playbooks/takeover.yml", "-e", json.dumps({"hsx_takeover_host": dead,
                                                                        "hsx_report_dir": str(tmp / "reports")}),
                           *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def recap(out: str, host: str) -> str:
    return next(ln for ln in out.splitlines() if ln.startswith(host) and "ok=" in ln)


def test_a_takeover_rerun_stops_a_retired_host_that_runs_on_and_its_metrics_say_retired(tmp_path) -> None:
    fleet = {"buckets": 6, "created": "x", "epoch": 1, "hosts": {"n1": "0-5", "n2": ""}, "retired": ["n2"],
             "history": []}
    (tmp_path / "fleet.json").write_text(json.dumps(fleet))
    plant_output(tmp_path / "n2", "2-3", [])  # partitioned while taken over: its job ran on
    (tmp_path / "textfile").mkdir()
    (tmp_path / "systemd").mkdir()
    (tmp_path / "systemd" / UNIT).write_text("active enabled\n")
    hosts = {"n2": {"hsx_output_dir": str(tmp_path / "n2"), "hsx_metrics_textfile_dir": str(tmp_path / "textfile")}}
    proc = takeover(tmp_path, "n2", hosts)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert (tmp_path / "systemd" / UNIT).read_text().split() == ["inactive", "disabled"]
    calls = (tmp_path / "systemd" / "calls.log").read_text()
    assert f"stop '{UNIT}'" in calls or f"stop {UNIT}" in calls, calls
    prom = tmp_path / "textfile" / "hsx-fleet.prom"
    assert "\nhsx_fleet_retired 1\n" in prom.read_text() and oct(prom.stat().st_mode & 0o777) == "0o644"
    assert sorted(p.name for p in (tmp_path / "textfile").iterdir()) == ["hsx-fleet.prom"]
    # The takeover's report, as a recovery's: reports/<timestamp>-takeover/summary.md and one JSON per host.
    (run,) = (tmp_path / "reports").glob("*-takeover")
    summary = (run / "summary.md").read_text()
    assert summary.startswith("# Takeover report") and "Nothing to move: n2 is already taken over (epoch 1" in summary, summary
    n2 = json.loads((run / "n2.json").read_text())
    assert n2["ok"] and "job stopped" in json.dumps(n2["checks"]), n2
    assert f"Report: {run}/summary.md" in flat(proc.stdout)
    # Again: nothing left to change.
    proc = takeover(tmp_path, "n2", hosts)
    assert proc.returncode == 0 and "changed=0" in recap(proc.stdout, "n2"), proc.stdout[-4000:]


def test_recover_never_starts_a_retired_host_even_with_the_finished_buckets_it_kept(tmp_path) -> None:
    """roles/extraction_deploy's configure step, as recover.yml runs it: the retired n2 kept bucket
    range 683-1023 (finished on its disk); it gets no bucket in its config and is marked idle."""
    (tmp_path / "fleet").mkdir()
    (tmp_path / "fleet" / "assignment.json").write_text(json.dumps({
        "buckets": 1024, "created": "x", "epoch": 1, "hosts": {"n1": "0-682", "n2": "683-1023", "n3": ""},
        "retired": ["n2", "n3"], "history": []}))
    (tmp_path / "n2").mkdir()
    (tmp_path / "n2" / "run.yaml").write_text("# as it was before the takeover\nassign: 342-1023\n")
    proc = play(tmp_path, ["n1", "n2", "n3"])
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert config(tmp_path, "n1")["assign"] == "0-682"
    assert yaml.safe_load((tmp_path / "n2" / "run.yaml").read_text()) == {"assign": "342-1023"}  # untouched
    assert not (tmp_path / "n3" / "run.yaml").exists()


def test_a_host_gone_from_the_inventory_is_taken_over_by_its_name_in_the_file(tmp_path) -> None:
    """gpu-node-9 was renamed (or removed) in the inventory: its buckets stay its own in the file,
    and nothing could move them. Named, it is taken over like an unreachable host (nothing of it
    counts as finished); a name in neither the file nor the inventory fails, naming both."""
    fleet = {"buckets": 6, "created": "x", "epoch": 0, "hosts": {"n1": "0-1", "n2": "2-3", "gone": "4-5"},
             "retired": [], "history": []}
    (tmp_path / "fleet.json").write_text(json.dumps(fleet))
    plant_output(tmp_path / "n1", "0-1", [])
    plant_output(tmp_path / "n2", "2-3", [])
    hosts = {h: {"hsx_output_dir": str(tmp_path / h)} for h in ("n1", "n2")}
    proc = takeover(tmp_path, "gone", hosts, "--check")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "Would move gone's unfinished buckets: n1 takes 4; n2 takes 5" in flat(proc.stdout), proc.stdout[-3000:]
    assert json.loads((tmp_path / "fleet.json").read_text()) == fleet
    proc = takeover(tmp_path, "nosuch", hosts, "--check")
    assert proc.returncode != 0 and "nosuch is not in the assignment" in flat(proc.stdout), proc.stdout[-3000:]
    # A takeover that could not plan still leaves its report, saying why nothing moved.
    summary = (sorted((tmp_path / "reports").glob("*-takeover"))[-1] / "summary.md").read_text()
    assert "nothing moved, no plan was made" in summary and "nosuch is not in the assignment" in summary, summary
    # In the inventory but left out of the play (--limit): not taken as gone, it must be in the play.
    proc = takeover(tmp_path, "n2", hosts, "--check", "--limit", "n1")
    assert proc.returncode != 0 and "is in the inventory but not in this play" in flat(proc.stdout), \
        proc.stdout[-3000:]
