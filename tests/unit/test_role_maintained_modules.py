"""Where a maintained module does the job, the roles use it (issue #42 item 5): node_exporter's state
in monitoring by ansible.builtin.systemd_service's `status`, not by a `systemctl is-active` command.
What the lab proves of it (node_exporter restarted only when it runs, a second run changes nothing):
tests/integration/test_monitoring.py. (extraction_deploy keeps its pip commands, for the reason
roles/extraction_deploy/tasks/install.yml states.)"""

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


def test_monitoring_reads_node_exporters_state_from_systemd_service():
    tasks = load(ROOT / "roles" / "monitoring" / "tasks" / "textfile.yml")
    assert not [t for t in tasks if "systemctl" in yaml.safe_dump(t.get("ansible.builtin.command", ""))]
    state = [t for t in tasks if "ansible.builtin.systemd_service" in t and t.get("register") == "_monitoring_ne_state"]
    assert len(state) == 1
    assert set(state[0]["ansible.builtin.systemd_service"]) == {"name"}  # reads only: no state, no enabled
    assert state[0]["check_mode"] is False
    facts = next(t for t in tasks if "_monitoring_ne_active" in t.get("ansible.builtin.set_fact", {}))
    active = facts["ansible.builtin.set_fact"]["_monitoring_ne_active"]
    active = facts.get("vars", {}).get(active.strip("{} "), active)  # through the task's own vars
    assert "_monitoring_ne_state.status" in active and "ActiveState" in active, active
