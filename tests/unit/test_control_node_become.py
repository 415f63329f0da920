"""Issue #39 item 5: a normal user on the control node.

Nothing the plays run on the control node (delegate_to: localhost, local_action, a play on localhost
or with connection: local, an include whose `apply` delegates to localhost) may inherit the
targets' become: each such task sets `become: false` itself or on an enclosing block, include
`apply` or localhost play. Otherwise it runs under sudo there: a root-owned wheelhouse and reports,
or a failure where the operator has no passwordless sudo on their own machine.

The plays act on the group `extraction_nodes` (`-e hsx_target=<pattern>` overrides), never on
`all`, and say so up front when the inventory has no such hosts (ansible alone would print "no
hosts matched" and exit 0).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}
TASK_LISTS = ("block", "rescue", "always")
PLAY_TASK_LISTS = ("pre_tasks", "tasks", "post_tasks", "handlers")
INCLUDES = {f"{prefix}{name}" for prefix in ("", "ansible.builtin.", "ansible.legacy.")
            for name in ("include_role", "import_role", "include_tasks", "import_tasks")}
TARGET = "{{ hsx_target | default('extraction_nodes') }}"
CHECK_PLAY = "shared/target.yml"


def yaml_files() -> list[Path]:
    """Every playbook and task file the project runs (and the lab's own plays)."""
    files = [ROOT / "recover.yml", *sorted((ROOT / "playbooks").rglob("*.yml")),
             *sorted(ROOT.glob("roles/*/tasks/*.yml")), *sorted((ROOT / "tests/plays").glob("*.yml"))]
    return [f for f in files if "vars" not in f.relative_to(ROOT).parts]


def is_playbook(doc: Any) -> bool:
    return isinstance(doc, list) and any(
        isinstance(e, dict) and ("hosts" in e or "import_playbook" in e or "ansible.builtin.import_playbook" in e)
        for e in doc)


def _local(entry: dict) -> bool:
    return (str(entry.get("delegate_to", "")).strip() in LOCAL_NAMES or "local_action" in entry
            or entry.get("connection") == "local")


def _include_apply(task: dict) -> dict:
    for key in INCLUDES & task.keys():
        args = task[key]
        if isinstance(args, dict) and isinstance(args.get("apply"), dict):
            return args["apply"]
    return {}


def _scope(entry: dict, local: bool, no_become: bool) -> tuple[bool, bool]:
    """(runs on the control node, become is off) for a task or block inside a scope."""
    if "become" in entry:
        no_become = entry["become"] is False
    return local or _local(entry), no_become


def offenders(tasks: list, where: str, local: bool, no_become: bool) -> Iterator[str]:
    """The tasks of `tasks` (and of their blocks) that run on the control node and can inherit become."""
    for task in tasks or []:
        if not isinstance(task, dict):
            continue
        task_local, task_no_become = _scope(task, local, no_become)
        if any(key in task for key in TASK_LISTS):
            for key in TASK_LISTS:
                yield from offenders(task.get(key) or [], where, task_local, task_no_become)
            continue
        apply = _include_apply(task)
        if apply:
            task_local, task_no_become = _scope(apply, task_local, task_no_become)
        if task_local and not task_no_become:
            yield f"{where}: {task.get('name', task)!r}"


def file_offenders(path: Path) -> list[str]:
    doc = yaml.safe_load(path.read_text()) or []
    where = str(path.relative_to(ROOT))
    if not is_playbook(doc):
        return list(offenders(doc, where, local=False, no_become=False))
    found: list[str] = []
    for play in doc:
        if not isinstance(play, dict) or "hosts" not in play:
            continue
        hosts = {h.strip() for h in str(play["hosts"]).replace(":", ",").split(",")}
        local = hosts <= LOCAL_NAMES or play.get("connection") == "local"
        no_become = play.get("become") is False
        for key in PLAY_TASK_LISTS:
            found += offenders(play.get(key) or [], f"{where} (play {play.get('name')!r})", local, no_become)
    return found


def test_nothing_on_the_control_node_can_inherit_become() -> None:
    files = yaml_files()
    assert len(files) > 20, files  # the scan found the project's files
    found = [o for f in files for o in file_offenders(f)]
    assert not found, "runs on the control node without become: false:\n" + "\n".join(found)


@pytest.mark.parametrize("task, inherits", [
    ({"name": "t", "command": "x", "delegate_to": "localhost"}, True),
    ({"name": "t", "command": "x", "delegate_to": "localhost", "become": False}, False),
    ({"name": "t", "local_action": "command x"}, True),
    ({"name": "b", "become": False, "block": [{"name": "t", "command": "x", "delegate_to": "localhost"}]}, False),
    ({"name": "b", "become": False, "block": [{"name": "t", "command": "x", "delegate_to": "localhost",
                                                "become": True}]}, True),
    ({"name": "b", "delegate_to": "localhost", "block": [{"name": "t", "command": "x"}]}, True),
    ({"name": "i", "include_role": {"name": "r", "apply": {"delegate_to": "localhost"}}}, True),
    ({"name": "i", "include_role": {"name": "r", "apply": {"delegate_to": "localhost", "become": False}}}, False),
    ({"name": "t", "command": "x", "delegate_to": "node-1"}, False),
])
def test_the_scan_sees_inherited_become(task: dict, inherits: bool) -> None:
    assert bool(list(offenders([task], "t.yml", local=False, no_become=False))) is inherits


def top_level_playbooks() -> list[Path]:
    return sorted((ROOT / "playbooks").glob("*.yml"))


@pytest.mark.parametrize("path", top_level_playbooks(), ids=lambda p: p.name)
def test_plays_act_on_the_target_group_after_checking_it(path: Path) -> None:
    """The first thing each playbook does is the target check; every play on nodes targets
    hsx_target (default extraction_nodes), never `all`."""
    doc = yaml.safe_load(path.read_text())
    first = doc[0]
    assert first.get("ansible.builtin.import_playbook") == CHECK_PLAY, f"{path.name} does not start with {CHECK_PLAY}"
    plays = [p for p in doc if "hosts" in p]
    assert plays and all(p["hosts"] == TARGET for p in plays), [p["hosts"] for p in plays]


def test_no_play_of_the_project_acts_on_all() -> None:
    """Every play under playbooks/ acts on the target; only the check looks at `localhost:all`
    (one task, on the control node)."""
    plays = [(f.relative_to(ROOT).as_posix(), p["hosts"]) for f in sorted((ROOT / "playbooks").rglob("*.yml"))
             for p in (yaml.safe_load(f.read_text()) or []) if isinstance(p, dict) and "hosts" in p]
    assert len(plays) > 5, plays
    wrong = [(f, h) for f, h in plays if h != TARGET and (f, h) != (f"playbooks/{CHECK_PLAY}", "localhost:all")]
    assert not wrong, wrong


def run_check(tmp_path: Path, inventory: dict | Path, *extra: str) -> subprocess.CompletedProcess:
    """Run the target check (playbooks/shared/target.yml) on an inventory; it connects to no host."""
    hosts = inventory if isinstance(inventory, Path) else tmp_path / "hosts.yml"
    if isinstance(inventory, dict):
        hosts.write_text(json.dumps(inventory))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    return subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(hosts),
         "-e", f"ansible_python_interpreter={sys.executable}", *extra, str(ROOT / "playbooks" / CHECK_PLAY)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


NODE = {"ansible_host": "127.0.0.1", "ansible_port": 1}


def test_an_inventory_without_the_group_is_refused_up_front(tmp_path: Path) -> None:
    """A site inventory listing login nodes in `all` but no extraction_nodes: the run stops
    before touching any host and says what to do, instead of "no hosts matched" and exit 0."""
    proc = run_check(tmp_path, {"all": {"hosts": {"login-1": NODE}}})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "extraction_nodes" in out and "hsx_target" in out, out


def test_the_group_or_the_override_passes_and_a_limit_outside_it_is_refused(tmp_path: Path) -> None:
    inventory = {"all": {"hosts": {"login-1": NODE}},
                 "extraction_nodes": {"hosts": {"gpu-1": NODE}}, "rack2": {"hosts": {"gpu-2": NODE}}}
    assert run_check(tmp_path, inventory).returncode == 0
    assert run_check(tmp_path, inventory, "-e", "hsx_target=rack2").returncode == 0
    limited = run_check(tmp_path, inventory, "--limit", "login-1")
    assert limited.returncode != 0 and "within --limit login-1" in limited.stdout, limited.stdout


def test_an_hsx_target_set_in_the_inventory_is_refused(tmp_path: Path) -> None:
    """A play's hosts see extra vars only: an inventory's hsx_target would be ignored and the plays
    would act on extraction_nodes (or nothing). Said, with the command line that works."""
    inventory = {"all": {"vars": {"hsx_target": "rack2"}, "hosts": {"login-1": NODE}},
                 "extraction_nodes": {"hosts": {"gpu-1": NODE}}, "rack2": {"hosts": {"gpu-2": NODE}}}
    proc = run_check(tmp_path, inventory)
    assert proc.returncode != 0 and "-e hsx_target=rack2" in proc.stdout, proc.stdout


def test_the_lab_inventory_puts_its_hosts_in_the_target_group(tmp_path: Path, monkeypatch) -> None:
    """What tests/lab/lab.py writes (inventory/lab runs it) passes the check with no hsx_target."""
    spec = importlib.util.spec_from_file_location("lab", ROOT / "tests/lab/lab.py")
    lab = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "lab", lab)  # dataclasses look their module up by name
    spec.loader.exec_module(lab)
    monkeypatch.setattr(lab, "lab_hosts", lambda: [lab.Host.make(1, "rw", "512M")])
    data = lab.inventory_data()
    script = tmp_path / "lab_hosts.py"
    script.write_text(f"#!{sys.executable}\nprint({json.dumps(json.dumps(data))})\n")
    script.chmod(0o755)
    proc = run_check(tmp_path, script)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"ok: [{lab.PREFIX}-1 -> localhost]" in proc.stdout, proc.stdout[-3000:]
