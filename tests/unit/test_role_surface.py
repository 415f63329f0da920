"""The roles as a user calls them (issue #42 item 3): tags named after the role on every task of each
role's tasks/main.yml, carried into the stage files it includes (`apply`), so `include_role` users can
select or skip a role or one stage of it (`--tags storage_guard_preflight`) the way the playbooks'
stage tags (`--tags storage`) select a stage of the recovery; argument specs for the hsx role's
shared entry points; `.ansible-lint` doing what `make lint` does."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ROLES = sorted(p.parent.parent.name for p in (ROOT / "roles").glob("*/tasks/main.yml"))
PLAYBOOK_STAGE_TAGS = {"assess", "gpus", "storage", "shards", "deploy", "patch", "server", "job", "monitoring"}


def _tags(task: dict) -> list[str]:
    tags = task.get("tags", [])
    return [tags] if isinstance(tags, str) else list(tags)


@pytest.mark.parametrize("role", ROLES)
def test_every_task_of_a_roles_main_carries_the_role_and_its_stage_as_tags(role):
    tasks = yaml.safe_load((ROOT / "roles" / role / "tasks" / "main.yml").read_text())
    assert tasks
    for task in tasks:
        assert role in _tags(task), (role, task["name"])
        include = task.get("ansible.builtin.include_tasks")
        if include is not None:
            assert isinstance(include, dict), (role, task["name"])  # `file:` + `apply:`, not the short form
            stage = f"{role}_{Path(include['file']).stem}"
            assert stage in _tags(task), (role, task["name"])
            # tags on an include select the include only: `apply` gives them to the stage's tasks
            assert sorted(_tags(include["apply"])) == sorted(_tags(task)), (role, task["name"])


def test_the_playbooks_stage_tags_are_still_there():
    found: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            found.update(_tags(node))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for path in (ROOT / "playbooks").glob("*.yml"):
        walk(yaml.safe_load(path.read_text()))
    assert PLAYBOOK_STAGE_TAGS <= found


def _play(tmp_path: Path, tasks: list[dict], *args: str) -> subprocess.CompletedProcess:
    play = [{"name": "entry points", "hosts": "localhost", "gather_facts": False, "tasks": tasks}]
    (tmp_path / "play.yml").write_text(json.dumps(play))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    return subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           "-e", f"ansible_python_interpreter={sys.executable}", *args, str(tmp_path / "play.yml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_hsx_roles_entry_points_validate_their_arguments(tmp_path):
    specs = yaml.safe_load((ROOT / "roles" / "hsx" / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    assert {"hsx_account_user", "hsx_account_group"} <= set(specs["account"]["options"])
    assert specs["own_tree"]["options"]["hsx_own_tree_paths"]["required"] is True
    record = {"ansible.builtin.copy": {"content": "{{ ansible_failed_result.msg }}", "mode": "0600",
                                       "dest": str(tmp_path / "own_tree.msg")}, "check_mode": False}
    tasks = [{"block": [{"ansible.builtin.include_role": {"name": "hsx", "tasks_from": "own_tree"}}],
              "rescue": [record]}]
    proc = _play(tmp_path, tasks, "--check")
    assert proc.returncode == 0, proc.stdout[-4000:]
    msg = (tmp_path / "own_tree.msg").read_text()
    assert "own_tree" in msg and "missing required arguments: hsx_own_tree_paths" in msg


def test_the_control_node_check_says_what_is_missing_and_how_to_provide_it(tmp_path):
    """Issue #42 item 4: the hsx CLI (and a named source checkout) the deploy needs on the control
    node, checked up front by the hsx role's entry point `control_node`."""
    def failure(*extra: str) -> str:
        record = {"ansible.builtin.copy": {"content": "{{ ansible_failed_result.msg }}", "mode": "0600",
                                           "dest": str(tmp_path / "control_node.msg")}, "check_mode": False}
        tasks = [{"block": [{"ansible.builtin.include_role": {"name": "hsx", "tasks_from": "control_node"}}],
                  "rescue": [record]}]
        (tmp_path / "control_node.msg").unlink(missing_ok=True)
        proc = _play(tmp_path, tasks, "--check", *extra)
        assert proc.returncode == 0, proc.stdout[-4000:]
        msg = tmp_path / "control_node.msg"
        return " ".join(msg.read_text().split()) if msg.exists() else ""

    assert failure() == ""  # this venv's hsx, next to the ansible-playbook that runs the play
    msg = failure("-e", f"hsx_cli={tmp_path}/nowhere/hsx")
    assert f"The hsx CLI is not at {tmp_path}/nowhere/hsx" in msg and "-m pip install -e CHECKOUT" in msg, msg
    assert "Nothing was changed" in msg
    msg = failure("-e", f"hsx_source={tmp_path}")
    assert f"The source checkout {tmp_path} (hsx_source) has no pyproject.toml" in msg, msg
    assert failure("-e", f"hsx_source={ROOT}") == ""


@pytest.mark.parametrize("role", ["extraction_deploy", "sglang_server"])
def test_the_roles_that_need_the_model_require_hsx_model_path(tmp_path, role):
    """Issue #42 item 3: the model has no default; the roles that use it stop at their argument
    validation, before anything changes, naming the setting."""
    specs = yaml.safe_load((ROOT / "roles" / role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    assert specs["main"]["options"]["hsx_model_path"]["required"] is True
    record = {"ansible.builtin.copy": {"content": "{{ ansible_failed_result.msg }}", "mode": "0600",
                                       "dest": str(tmp_path / "role.msg")}, "check_mode": False}
    tasks = [{"block": [{"ansible.builtin.include_role": {"name": role}}], "rescue": [record]}]
    proc = _play(tmp_path, tasks, "--check")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "'hsx_model_path' is undefined" in (tmp_path / "role.msg").read_text()
    failed_task = [line for line in proc.stdout.split("fatal:")[0].splitlines() if line.startswith("TASK [")][-1]
    assert f"TASK [{role} : Validating arguments against arg spec 'main'" in failed_task, failed_task


def test_every_role_has_a_molecule_scenario_or_a_named_test_that_plays_it():
    """Issue #42 item 3: tests/molecule/README.md names, for each role, its scenario or the tests that
    play the same part; each named scenario and test exists."""
    readme = (ROOT / "tests" / "molecule" / "README.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| ([a-z_]+) \| (`.+?) \|", readme, re.M)}
    assert sorted(p.name for p in (ROOT / "roles").iterdir() if p.is_dir()) == sorted(rows)
    for role, cell in rows.items():
        names = re.findall(r"`([^`]+)`", cell)
        assert names, role
        for name in names:
            if "::" not in name:
                assert (ROOT / "tests" / "molecule" / name / "molecule.yml").is_file(), (role, name)
                continue
            path, func = name.split("::")
            path = ROOT / (path if path.startswith("tests/") else f"tests/integration/{path}")
            assert re.search(rf"^def {re.escape(func)}\(", path.read_text(), re.M), (role, name)
