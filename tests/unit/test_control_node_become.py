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
