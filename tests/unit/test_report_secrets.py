"""Issue #30 item 8: what a run leaves on the control node keeps secrets to root. Report directories
are 0700 and their files 0600 (the recover_report role and `hsx report`), what they hold is redacted
(hsx.redact), ansible-runner's `command` artifact (os.environ) is scrubbed even when the run raises,
and the unit files that may carry secret Environment= values are 0600 and never shown by --diff."""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from extraction.fleet import playbook
from extraction.fleet.report import build

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cret-value"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_hsx_report_writes_private_files_and_redacts(tmp_path):
    facts = tmp_path / "facts"
    facts.mkdir()
    (facts / "node-1.json").write_text(json.dumps({
        "host": "node-1", "mode": "apply", "failed_stage": "gpus", "failed_task": "End stray GPU processes",
        "failed_msg": f"pid 7 (vllm serve /m --api-key {SECRET}) still alive"}))
    (tmp_path / "hosts.json").write_text(json.dumps(["node-1", "node-2"]))
    old = tmp_path / "node-2.json"  # an earlier build's file, world-readable
    old.write_text("{}")
    old.chmod(0o644)
    build(tmp_path)
    for name in ("node-1.json", "node-2.json", "summary.md"):
        assert mode(tmp_path / name) == 0o600, name
        assert SECRET not in (tmp_path / name).read_text()
    assert "--api-key <redacted>" in json.loads((tmp_path / "node-1.json").read_text())["reason"]


PLAY = """
- name: A run that reports, on the control node
  hosts: localhost
  gather_facts: false
  vars:
    recover_report_dir: {reports}
  tasks:
    - name: Start the report
      ansible.builtin.include_role:
        name: recover_report
        tasks_from: start
    - name: A role result holding a command line with a key
      ansible.builtin.set_fact:
        node_assess_report:
          gpu:
            processes:
              - {{pid: 7, cmdline: "vllm serve /m --api-key {secret} --port 8000"}}
        sglang_server_result:
          command: [/v/bin/python, -m, sglang.launch_server, --api-key, {secret}]
          environment: {{SGLANG_API_KEY: {secret}, HSX_DUMP_DIR: /data/hsx/dumps}}
    - name: A stage that fails saying the key
      block:
        - name: Fail
          ansible.builtin.fail:
            msg: "server refused --api-key={secret}"
      rescue:
        - name: Record the failure
          ansible.builtin.include_role:
            name: recover_report
            tasks_from: failed
    - name: Dump this host's results
      ansible.builtin.include_role:
        name: recover_report
    - name: Build
      ansible.builtin.include_role:
        name: recover_report
        tasks_from: build
      vars:
        recover_report_hosts: [localhost]
"""


def test_recover_report_role_writes_private_redacted_reports(tmp_path):
    reports = tmp_path / "reports"
    play = tmp_path / "play.yml"
    play.write_text(PLAY.format(reports=reports, secret=SECRET))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"), ANSIBLE_NOCOLOR="1")
    proc = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "-c", "local",
                           "-e", f"ansible_python_interpreter={sys.executable}", str(play)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    (run_dir,) = reports.iterdir()
    assert mode(reports) == 0o700 and mode(run_dir) == 0o700 and mode(run_dir / "facts") == 0o700
    files = sorted(p for p in run_dir.rglob("*") if p.is_file())
    assert {p.relative_to(run_dir).as_posix() for p in files} == {
        "facts/localhost.json", "hosts.json", "localhost.json", "summary.md"}
    for path in files:
        assert mode(path) == 0o600, path
        assert SECRET not in path.read_text(), path
    dumped = json.loads((run_dir / "facts" / "localhost.json").read_text())
    assert dumped["node_assess_report"]["gpu"]["processes"][0]["cmdline"] == \
        "vllm serve /m --api-key <redacted> --port 8000"
    assert dumped["sglang_server_result"]["environment"] == {"SGLANG_API_KEY": "<redacted>",
                                                             "HSX_DUMP_DIR": "/data/hsx/dumps"}
    assert dumped["failed_msg"] == "server refused --api-key=<redacted>"


def _args(tmp_path: Path) -> argparse.Namespace:
    return argparse.Namespace(inventory=None, limit=None, check=True, diff=False, extra_vars=[f"api_key={SECRET}"],
                              tags=None, skip_tags=None, report_dir=tmp_path / "reports")


def _command(artifact_dir: Path) -> Path:
    artifact_dir.mkdir(parents=True)
    command = artifact_dir / "command"
    command.write_text(json.dumps({"command": ["ansible-playbook", "-e", f"api_key={SECRET}", "recover.yml"],
                                   "cwd": str(ROOT), "env": {"HF_TOKEN": SECRET, "PATH": "/usr/bin"}}))
    command.chmod(0o600)
    return command


@pytest.mark.parametrize("error", [RuntimeError("the event handler broke"), KeyboardInterrupt()])
def test_runner_artifacts_are_scrubbed_when_the_run_raises(tmp_path, monkeypatch, error):
    """ansible-runner writes os.environ into artifacts/<ident>/command first; a run that raises (an
    exception in our event handler, Ctrl-C) must not leave it there. A run killed before it could
    scrub is scrubbed by the next one."""
    import ansible_runner

    pdd = tmp_path / "reports" / ".runner"
    left_by_a_killed_run = _command(pdd / "artifacts" / "20261201T000000Z-recover-1")
    written = []

    def run(**kw):
        written.append(_command(Path(kw["private_data_dir"]) / "artifacts" / kw["ident"]))
        raise error

    monkeypatch.setattr(ansible_runner, "run", run)
    with pytest.raises(type(error)):
        playbook.run_playbook(_args(tmp_path), "recover.yml", "recover", out=open(os.devnull, "w"))  # noqa: SIM115
    for command in (*written, left_by_a_killed_run):
        text = command.read_text()
        assert SECRET not in text and "env" not in json.loads(text), command
        assert mode(command) == 0o600


UNIT_TASKS = {
    "roles/extraction_job/tasks/install.yml": "hsx-extraction.service.j2",
    "roles/sglang_server/tasks/install.yml": "hsx-sglang-server.service.j2",
}


@pytest.mark.parametrize("tasks_file", sorted(UNIT_TASKS))
def test_unit_files_with_environment_values_are_private_and_never_diffed(tasks_file):
    tasks = yaml.safe_load((ROOT / tasks_file).read_text())
    (task,) = [t for t in tasks if (t.get("ansible.builtin.template") or {}).get("src") == UNIT_TASKS[tasks_file]]
    assert str(task["ansible.builtin.template"]["mode"]) == "0600", task
    assert task.get("diff") is False or task.get("no_log") is True, task
