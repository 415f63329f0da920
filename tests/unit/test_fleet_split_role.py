"""Issue #39 item 2: the roles render each host's buckets into the job's config.

ansible-playbook runs roles/extraction_deploy's configure step (which takes this host's buckets
from roles/extraction_job/tasks/assignment.yml) on local stand-in hosts: every bucket on exactly one
host, one assignment file on the control node, and explicit hsx_shard_index/hsx_num_shards winning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from hsx.buckets import parse_assign

ROOT = Path(__file__).resolve().parents[2]


def play(tmp: Path, hosts: list[str], *args: str, **group_vars: object) -> subprocess.CompletedProcess:
    """configure.yml on `hosts` (local stand-ins); each host's config at tmp/<host>/run.yaml."""
    py = sys.executable
    inventory = {"all": {"hosts": {h: {"ansible_connection": "local", "ansible_python_interpreter": py} for h in hosts},
                         "vars": {"hsx_assignment_file": str(tmp / "fleet" / "assignment.json"), "hsx_model_path": "/m",
                                  "hsx_dataset_path": "/d.jsonl", "hsx_output_dir": "/o", **group_vars}}}
    (tmp / "inventory.json").write_text(json.dumps(inventory))
    tasks = [{"ansible.builtin.include_role": {"name": "extraction_deploy", "tasks_from": "configure"},
              "vars": {"extraction_deploy_config_path": str(tmp) + "/{{ inventory_hostname }}/run.yaml"}}]
    (tmp / "play.yml").write_text(json.dumps([{"hosts": "all", "gather_facts": False, "become": True,
                                               "tasks": tasks}]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    return subprocess.run([str(Path(py).parent / "ansible-playbook"), "-i", str(tmp / "inventory.json"),
                           str(tmp / "play.yml"), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def config(tmp: Path, host: str) -> dict:
    return yaml.safe_load((tmp / host / "run.yaml").read_text())


def test_each_host_gets_its_buckets_and_the_fleet_runs_every_bucket_once(tmp_path) -> None:
    hosts = ["n3", "n1", "n2"]
    proc = play(tmp_path, hosts)
    assert proc.returncode == 0, proc.stdout[-3000:]
    recorded = json.loads((tmp_path / "fleet" / "assignment.json").read_text())
    assert recorded["hosts"] == {"n1": "0-341", "n2": "342-682", "n3": "683-1023"}
    owned = []
    for h in hosts:
        cfg = config(tmp_path, h)
        assert cfg["buckets"] == 1024 and cfg["assign"] == recorded["hosts"][h] and cfg["num_shards"] == 1
        owned += sorted(parse_assign(cfg["assign"], 1024))
    assert sorted(owned) == list(range(1024))
    # A fourth host: the assignment is read, not derived again; the play says which host is new.
    before = (tmp_path / "fleet" / "assignment.json").read_bytes()
    proc = play(tmp_path, [*hosts, "n4"])
    assert proc.returncode != 0 and "host(s) n4 are not in the assignment" in proc.stdout
    assert "-e hsx_rebalance=true" in proc.stdout
    assert (tmp_path / "fleet" / "assignment.json").read_bytes() == before
    # A rebalance is deliberate (-e hsx_rebalance=true), --check first: n4 gets only buckets no
    # node has started (these stand-ins have no output: none has), an even share.
    proc = play(tmp_path, [*hosts, "n4"], "-e", "hsx_rebalance=true", "--check")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "Would move unstarted buckets to the new or returning host(s): n4 gets " in " ".join(proc.stdout.split())
    assert (tmp_path / "fleet" / "assignment.json").read_bytes() == before
    proc = play(tmp_path, [*hosts, "n4"], "-e", "hsx_rebalance=true")
    assert proc.returncode == 0, proc.stdout[-3000:]
    after = json.loads((tmp_path / "fleet" / "assignment.json").read_text())
    assert after["epoch"] == 1 and len(parse_assign(after["hosts"]["n4"], 1024)) == 256
    # What the hosts read reported finished is recorded beside it (issue #51: a takeover parks it).
    record = json.loads((tmp_path / "fleet" / "finished.json").read_text())
    assert record["hosts"] and {e["by"] for e in record["hosts"].values()} == {"rebalance"}
    assert config(tmp_path, "n4")["assign"] == after["hosts"]["n4"]
    assert sorted(b for h in after["hosts"].values() for b in parse_assign(h, 1024)) == list(range(1024))
    # A host taken over (it owns nothing, retired) keeps its config as it was: never "the whole dataset".
    n1_before = (tmp_path / "n1" / "run.yaml").read_text()
    after["hosts"]["n2"] += "," + after["hosts"]["n1"]
    after["hosts"]["n1"], after["retired"] = "", ["n1"]
    (tmp_path / "fleet" / "assignment.json").write_text(json.dumps(after))
    proc = play(tmp_path, [*hosts, "n4"])
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert (tmp_path / "n1" / "run.yaml").read_text() == n1_before
    assert config(tmp_path, "n2")["assign"] == after["hosts"]["n2"]


def test_explicit_shards_win_and_a_fleet_of_one_runs_everything(tmp_path) -> None:
    (tmp_path / "legacy").mkdir()
    proc = play(tmp_path / "legacy", ["n1", "n2"], hsx_shard_index=1, hsx_num_shards=2)
    assert proc.returncode == 0, proc.stdout[-3000:]
    cfg = config(tmp_path / "legacy", "n2")
    assert (cfg["shard_index"], cfg["num_shards"]) == (1, 2) and "assign" not in cfg and "buckets" not in cfg
    assert not (tmp_path / "legacy" / "fleet").exists()
    (tmp_path / "one").mkdir()
    proc = play(tmp_path / "one", ["n1", "n2"], "--limit", "n1")  # never made from part of the fleet
    assert proc.returncode != 0 and "this play runs on part of the fleet (--limit)" in proc.stdout
    assert not (tmp_path / "one" / "fleet").exists()
    proc = play(tmp_path / "one", ["n1"])
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "assign" not in config(tmp_path / "one", "n1")
    assert json.loads((tmp_path / "one" / "fleet" / "assignment.json").read_text())["hosts"] == {"n1": "0-1023"}


def test_a_rebalance_needs_every_host_read_and_an_unreadable_index_is_not_an_answer(tmp_path) -> None:
    """#39 review 5: n2's output has an index that cannot be read (a link, never followed): its
    started buckets are unknown, so it did not answer and nothing moves."""
    outputs = str(tmp_path) + "/{{ inventory_hostname }}/out"
    assert play(tmp_path, ["n1", "n2"], hsx_output_dir=outputs).returncode == 0
    before = (tmp_path / "fleet" / "assignment.json").read_bytes()
    (tmp_path / "n2" / "out").mkdir()
    (tmp_path / "n2" / "out" / "run.json").write_text('{"buckets": 1024}')
    (tmp_path / "n2" / "out" / "index.jsonl").symlink_to(tmp_path / "elsewhere")
    proc = play(tmp_path, ["n1", "n2", "n3"], "-e", "hsx_rebalance=true", hsx_output_dir=outputs)
    assert proc.returncode != 0 and "cannot rebalance: host(s) n2 did not answer" in " ".join(proc.stdout.split())
    assert (tmp_path / "fleet" / "assignment.json").read_bytes() == before


def test_a_takeover_survivor_owning_every_bucket_stays_a_fleet_member(tmp_path) -> None:
    """#39 review 6: in a 2-host fleet the survivor of a takeover owns 0-1023. The file names more
    than one host, so it keeps buckets/assign in its config (and its job off at boot: defaults
    extraction_job_enabled), unlike a fleet of one."""
    assert play(tmp_path, ["n1", "n2"]).returncode == 0
    fleet = json.loads((tmp_path / "fleet" / "assignment.json").read_text())
    fleet["hosts"], fleet["retired"], fleet["epoch"] = {"n1": "0-1023", "n2": ""}, ["n2"], 1
    (tmp_path / "fleet" / "assignment.json").write_text(json.dumps(fleet))
    proc = play(tmp_path, ["n1", "n2"])
    assert proc.returncode == 0, proc.stdout[-3000:]
    cfg = config(tmp_path, "n1")
    assert cfg["buckets"] == 1024 and cfg["assign"] == "0-1023"
