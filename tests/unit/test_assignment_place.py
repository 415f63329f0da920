"""Issue #51 item 7: the assignment file's default place inside the inventory directory
(`fleet/assignment.json`) made every later `ansible-playbook -i DIR` read it as an inventory source
(8 "not a valid group definition" warnings, and a bogus group `hosts`): Ansible's inventory loader
parses every file under a directory source except names starting with "." (always) and the
INVENTORY_IGNORE_EXTS/PATTERNS settings (.json is not among them; the yaml plugin takes it). Its
default place is now `.fleet/assignment.json` beside the inventory's files; a file at the old place
is moved there by the next play that reads it (read and checked first, its bytes kept; never lost).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from extraction.commands.fleet_status import load_assignment

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
OLD = {"buckets": 8, "created": "2026-01-02T00:00:00+00:00", "epoch": 2,
       "hosts": {"n1": "0-2", "n2": "3-7"}, "retired": [], "history": [{"epoch": 1}, {"epoch": 2}]}


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    e.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    return e


def inventory(tmp: Path) -> Path:
    """An operator's inventory directory (no hsx_assignment_file: the default place)."""
    inv = tmp / "inv"
    inv.mkdir(exist_ok=True)
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    (inv / "hosts.yml").write_text(yaml.safe_dump({"extraction_nodes": {
        "hosts": {"n1": local, "n2": local},
        "vars": {"hsx_model_path": "/m", "hsx_dataset_path": "/d.jsonl", "hsx_output_dir": "/o", "hsx_buckets": 8}}}))
    return inv


def configure(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """roles/extraction_deploy's configure step (it takes each host's buckets from the file)."""
    tasks = [{"ansible.builtin.include_role": {"name": "extraction_deploy", "tasks_from": "configure"},
              "vars": {"extraction_deploy_config_path": str(tmp / "cfg") + "/{{ inventory_hostname }}.yaml"}}]
    (tmp / "play.yml").write_text(json.dumps([{"hosts": "extraction_nodes", "gather_facts": False,
                                               "become": False, "tasks": tasks}]))
    return subprocess.run([str(BIN / "ansible-playbook"), "-i", str(tmp / "inv"), str(tmp / "play.yml"), *args],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)


def inventory_warnings(inv: Path) -> tuple[str, dict]:
    proc = subprocess.run([str(BIN / "ansible-inventory"), "-i", str(inv), "--list"], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr, json.loads(proc.stdout)


def test_the_default_place_is_one_ansible_never_reads_as_inventory(tmp_path) -> None:
    inv = inventory(tmp_path)
    proc = configure(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    made = inv / ".fleet" / "assignment.json"
    assert json.loads(made.read_text())["hosts"] == {"n1": "0-3", "n2": "4-7"}
    assert not (inv / "fleet").exists()
    warnings, listed = inventory_warnings(inv)
    assert "WARNING" not in warnings and "hosts" not in listed["all"].get("children", []), warnings
    assert load_assignment(None, [str(inv)])["hosts"] == {"n1": "0-3", "n2": "4-7"}


def test_a_file_at_the_old_place_is_moved_whole_by_the_next_play(tmp_path) -> None:
    inv = inventory(tmp_path)
    old = inv / "fleet" / "assignment.json"
    old.parent.mkdir()
    old.write_text(json.dumps(OLD, indent=1) + "\n")
    (inv / "fleet" / "assignment.json.lock").write_bytes(b"")
    raw = old.read_bytes()
    warnings, _ = inventory_warnings(inv)
    assert "not a valid group definition" in warnings  # what an operator met
    assert load_assignment(None, [str(inv)])["epoch"] == 2  # fleet-status reads it where it is, until moved
    # --check reads it where it is and moves nothing.
    proc = configure(tmp_path, "--check")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert old.read_bytes() == raw and not (inv / ".fleet" / "assignment.json").exists()
    proc = configure(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    new = inv / ".fleet" / "assignment.json"
    assert new.read_bytes() == raw  # the very bytes: epoch, history and all
    assert not (inv / "fleet").exists()  # its lock and its directory too: nothing left to parse
    said = " ".join((proc.stdout + proc.stderr).split())
    assert f"moved the fleet's assignment from {old} to {new}" in said, said[-3000:]
    assert yaml.safe_load((tmp_path / "cfg" / "n1.yaml").read_text())["assign"] == "0-2"  # the old file's split
    warnings, _ = inventory_warnings(inv)
    assert "WARNING" not in warnings, warnings
    proc = configure(tmp_path)  # and again: nothing moves, nothing changes
    assert proc.returncode == 0 and "changed=0" in proc.stdout, proc.stdout[-3000:]


def test_a_broken_file_at_the_old_place_fails_naming_it_and_stays(tmp_path) -> None:
    inv = inventory(tmp_path)
    old = inv / "fleet" / "assignment.json"
    old.parent.mkdir()
    old.write_text('{"buckets": 8, "hosts": {"n1": "0-2"}}')  # buckets 3-7 on no host
    proc = configure(tmp_path)
    assert proc.returncode != 0 and str(old) in proc.stdout, proc.stdout[-3000:]
    assert old.read_text() == '{"buckets": 8, "hosts": {"n1": "0-2"}}'
    assert not (inv / ".fleet" / "assignment.json").exists()
