"""Two role entry points, played for real on localhost in one ansible-playbook run (issue #50 items 6
and 8): `hsx:os_check`, which roles/monitoring runs before its apt task - this Debian machine passes,
and the same machine with only another family allowed stops, naming the node's distribution and the
supported families; and `monitoring:rules_files`, the absolute paths of the shipped alert rule files
that prometheus.prometheus's `prometheus_alert_rules_files` takes (globbed by `fileglob` on the
control node, as that role does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = ROOT / "roles" / "monitoring" / "files"


def test_os_check_and_rules_files(tmp_path: Path) -> None:
    def record(name: str, content: str) -> dict:
        return {"ansible.builtin.copy": {"content": content, "mode": "0600", "dest": str(tmp_path / name)},
                "check_mode": False}

    # What prometheus.prometheus.prometheus's configure task loops over (its fileglob | realpath).
    globbed = ("{{ (['prometheus/rules/*.yml'] + monitoring_rules_files) | map('ansible.builtin.fileglob') | flatten"
               " | map('ansible.builtin.realpath') | to_json }}")
    tasks = [
        {"ansible.builtin.include_role": {"name": "hsx", "tasks_from": "os_check"}},
        {"ansible.builtin.include_role": {"name": "monitoring", "tasks_from": "rules_files"}},
        record("rules.json", globbed),
        {"ansible.builtin.include_role": {"name": "monitoring", "tasks_from": "rules_files"},
         "vars": {"monitoring_selfheal_rules": False}},
        record("rules-without-selfheal.json", "{{ monitoring_rules_files | to_json }}"),
        {"block": [{"ansible.builtin.include_role": {"name": "hsx", "tasks_from": "os_check"},
                    "vars": {"hsx_os_families": ["RedHat", "Suse"], "hsx_os_check_skip": "the_setting: false"}}],
         "rescue": [record("os.msg", "{{ ansible_failed_result.msg }}")]},
    ]
    play = [{"name": "entry points", "hosts": "localhost", "gather_facts": False, "tasks": tasks}]
    (tmp_path / "play.yml").write_text(json.dumps(play))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           "-e", f"ansible_python_interpreter={sys.executable}", "--check", str(tmp_path / "play.yml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    # The first os_check passed on this Debian machine (else the play had failed before the rescue).
    assert json.loads((tmp_path / "rules.json").read_text()) == [
        str(FILES / "hsx.rules.yml"), str(FILES / "hsx-selfheal.rules.yml")]
    assert json.loads((tmp_path / "rules-without-selfheal.json").read_text()) == [str(FILES / "hsx.rules.yml")]
    msg = " ".join((tmp_path / "os.msg").read_text().split())
    assert "localhost runs Debian" in msg and "(OS family Debian)" in msg, msg
    assert "on the OS families RedHat, Suse only" in msg and "Nothing was changed" in msg, msg
    assert "(the_setting: false)" in msg, msg
