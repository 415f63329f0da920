"""Where a maintained module does the job, the roles use it (issue #42 item 5): the venv and the
wheel installs of extraction_deploy by ansible.builtin.pip (from the wheelhouse only: --no-index,
--find-links, and the compile setting), node_exporter's state in monitoring by
ansible.builtin.systemd_service's `status`, not by a `systemctl is-active` command. What the lab
proves of them (a second provision changes nothing; node_exporter restarted only when it runs):
tests/integration/test_provision.py and test_monitoring.py."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def tasks_of(tasks: list[dict]) -> list[dict]:
    """Every task of a list of tasks, in order, those inside blocks included."""
    out: list[dict] = []
    for task in tasks:
        out.append(task)
        for key in ("block", "rescue", "always"):
            out += tasks_of(task.get(key, []))
    return out


def load(path: Path) -> list[dict]:
    return tasks_of(yaml.safe_load(path.read_text()))


def test_extraction_deploy_installs_by_the_pip_module_from_the_wheelhouse_only():
    tasks = load(ROOT / "roles" / "extraction_deploy" / "tasks" / "install.yml")
    commands = [t for t in tasks if "ansible.builtin.command" in t or "ansible.builtin.shell" in t]
    assert commands == []  # no `python -m venv`, no `pip install` command left
    pips = [t for t in tasks if "ansible.builtin.pip" in t]
    assert len(pips) == 2
    for task in pips:
        args = task["ansible.builtin.pip"]
        assert args["virtualenv"] == "{{ extraction_deploy_venv }}"
        assert args["virtualenv_command"] == "{{ extraction_deploy_python }} -m venv"
        assert args["name"].endswith("{{ _extraction_deploy_manifest.package_wheel }}")
        extra = args["extra_args"]
        assert "--no-index" in extra and "--no-compile" in extra and "--disable-pip-version-check" in extra
        assert "--quiet" not in extra  # the module sees a change in pip's "Successfully installed"
        assert task["when"] == "_extraction_deploy_needed"  # the digest gate: a second run changes nothing
    assert "--find-links" in pips[0]["ansible.builtin.pip"]["extra_args"]
    assert pips[1]["ansible.builtin.pip"]["state"] == "forcereinstall"
    assert "--no-deps" in pips[1]["ansible.builtin.pip"]["extra_args"]


def test_monitoring_reads_node_exporters_state_from_systemd_service():
    tasks = load(ROOT / "roles" / "monitoring" / "tasks" / "textfile.yml")
    assert not [t for t in tasks if "systemctl" in yaml.safe_dump(t.get("ansible.builtin.command", ""))]
    state = [t for t in tasks if "ansible.builtin.systemd_service" in t and t.get("register") == "_monitoring_ne_state"]
    assert len(state) == 1
    assert set(state[0]["ansible.builtin.systemd_service"]) == {"name"}  # reads only: no state, no enabled
    assert state[0]["check_mode"] is False
    facts = next(t for t in tasks if "_monitoring_ne_active" in t.get("ansible.builtin.set_fact", {}))
    assert "_monitoring_ne_state.status" in facts["ansible.builtin.set_fact"]["_monitoring_ne_active"]
