"""The self-healing rulebook's decisions (extensions/eda/rulebooks/selfheal.yml), by the real
ansible-rulebook (drools on Java): Alertmanager's webhook payloads posted to its webhook source; which
remedy runs on which host is recorded by stand-in remedy playbooks (a checkout whose recover.yml and
playbooks/takeover.yml only write down what they were asked to do, on localhost connections), which
the real remedy wrapper (extensions/eda/playbooks/selfheal_remedy.yml) runs in place. Alertmanager's payload
shape: DESIGN.md section 10. The lab test (tests/integration/test_self_healing.py) runs the real
recover.yml end to end; this one is also the takeover rule's only test (its playbook is another issue's)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RULEBOOK = REPO / "extensions" / "eda" / "rulebooks" / "selfheal.yml"
# recover.yml runs with --limit HOST; playbooks/takeover.yml on the fleet with -e hsx_takeover_host=HOST.
RECORDER = """
- name: Stand-in remedy ({what}), writing down what it was asked to do
  hosts: {hosts}
  connection: local
  gather_facts: false
  tasks:
    - name: Record
      ansible.builtin.shell: "echo '{what} {{{{ {who} }}}} {{{{ hsx_selfheal }}}} {{{{ hsx_report_dir }}}}' >> {record}"
      changed_when: true
      run_once: true
"""


def alert(status: str, host: str | None, remedy: str | None, name: str = "HsxSelfHealStalled") -> dict:
    labels = {"alertname": name, "instance": "10.0.0.1:9100", "severity": "warning"}
    if host:
        labels["hsx_host"] = host
    if remedy:
        labels["hsx_remedy"] = remedy
    return {"status": status, "labels": labels, "annotations": {}, "startsAt": "2026-12-06T00:00:00Z",
            "endsAt": "0001-01-01T00:00:00Z", "fingerprint": f"{name}{host}"}


def post(port: int, *alerts: dict) -> None:
    """One notification as Alertmanager's webhook receiver sends it (version 4)."""
    body = {"version": "4", "status": alerts[0]["status"], "receiver": "hsx-selfheal", "alerts": list(alerts),
            "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://am", "groupKey": "k"}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(f"http://127.0.0.1:{port}/alerts", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with opener.open(req, timeout=10) as r:
        assert r.status == 200


@pytest.fixture
def rulebook(tmp_path: Path):
    if not shutil.which("java") and not os.environ.get("JAVA_HOME"):
        pytest.skip("no Java runtime (make lab-ensure installs openjdk-17-jre-headless)")
    project, record = tmp_path / "checkout", tmp_path / "record.txt"
    (project / "extensions" / "eda" / "playbooks").mkdir(parents=True)
    (project / "playbooks").mkdir()
    shutil.copy(REPO / "extensions" / "eda" / "playbooks" / "selfheal_remedy.yml",
                project / "extensions" / "eda" / "playbooks")
    (project / "recover.yml").write_text(RECORDER.format(what="recover", hosts="all", who="ansible_limit", record=record))
    (project / "playbooks" / "takeover.yml").write_text(
        RECORDER.format(what="takeover", hosts="localhost", who="hsx_takeover_host", record=record))
    (project / "ansible.cfg").write_text("[defaults]\n")
    (tmp_path / "hosts.ini").write_text(f"[extraction_nodes]\nnode-1\nnode-2\n[all:vars]\nansible_python_interpreter={sys.executable}\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, HSX_PROJECT_DIR=str(project), ANSIBLE_INVENTORY=str(tmp_path / "hosts.ini"),
               PATH=f"{BIN}:{os.environ['PATH']}", ANSIBLE_LOCALHOST_WARNING="0")
    (tmp_path / "vars.yml").write_text(f"hsx_selfheal_port: {port}\n")
    log = open(tmp_path / "rulebook.log", "wb")  # noqa: SIM115 - the process's, closed with it
    proc = subprocess.Popen([str(BIN / "ansible-rulebook"), "-r", str(RULEBOOK), "-E", "HSX_PROJECT_DIR,ANSIBLE_INVENTORY",
                             "--vars", str(tmp_path / "vars.yml")], cwd=tmp_path, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert proc.poll() is None, (tmp_path / "rulebook.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the rulebook's webhook did not open in 90 s"
                time.sleep(0.5)
        yield port, record, tmp_path / "rulebook.log"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def wait_lines(record: Path, n: int, timeout: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = record.read_text().splitlines() if record.exists() else []
        if len(lines) >= n:
            return lines
        time.sleep(0.5)
    return record.read_text().splitlines() if record.exists() else []


def test_each_remedy_runs_on_the_alerts_host_only_once_per_window(rulebook) -> None:
    port, record, log = rulebook
    project = record.parent / "checkout"
    # Not acted on: resolved, no host named, no remedy asked (the "needs a person" alert).
    post(port, alert("resolved", "node-1", "recover"))
    post(port, alert("firing", None, "recover"))
    post(port, alert("firing", "node-1", None, name="HsxSelfHealGaveUp"))
    # Not acted on: a "host" that is a pattern, or a group of the inventory.
    post(port, alert("firing", "node-*", "recover"))
    post(port, alert("firing", "extraction_nodes", "takeover", "HsxSelfHealNodeDown"))
    # Acted on: one notification of two alerts, split into two events.
    post(port, alert("firing", "node-1", "recover"), alert("firing", "node-2", "takeover", "HsxSelfHealNodeDown"))
    lines = wait_lines(record, 2)
    # Within the window: the same remedy for the same host again is ignored.
    post(port, alert("firing", "node-1", "recover"))
    post(port, alert("firing", "node-2", "takeover", "HsxSelfHealNodeDown"))
    time.sleep(8)
    lines = record.read_text().splitlines()
    assert sorted(lines) == [f"recover node-1 True {project}/reports", f"takeover node-2 True {project}/reports"], \
        log.read_text()[-4000:]


def _guard(tmp_path: Path, failures: int | None, *extra: str) -> subprocess.CompletedProcess:
    """playbooks/shared/selfheal_guard.yml (recover.yml's first play after the target check) on this machine."""
    textfile = tmp_path / "textfile"
    textfile.mkdir(exist_ok=True)
    if failures is not None:
        (textfile / "hsx-recover.prom").write_text(f"hsx_recover_success 0\nhsx_recover_automatic_failures {failures}\n")
    env = dict(os.environ, ANSIBLE_ROLES_PATH=str(REPO / "roles"), ANSIBLE_NOCOLOR="1", ANSIBLE_LOCALHOST_WARNING="0")
    args = {"hsx_target": "localhost", "hsx_become": False, "hsx_metrics_textfile_dir": str(textfile),
            "ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    return subprocess.run([str(BIN / "ansible-playbook"), "-i", "localhost,", str(REPO / "playbooks/shared/selfheal_guard.yml"),
                           "-e", json.dumps(args), *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_recover_yml_refuses_an_automatic_run_at_the_limit_and_never_a_persons(tmp_path: Path) -> None:
    auto = ["-e", "hsx_selfheal=true", "-e", "hsx_selfheal_max_failures=2"]
    refused = _guard(tmp_path, 2, *auto)
    assert refused.returncode != 0 and "self-healing leaves this host alone: its last 2 automatic" in refused.stdout, \
        refused.stdout[-3000:]
    for failures, args in [(1, auto), (None, auto), (5, ["-e", "hsx_selfheal=false"]), (5, [])]:
        if failures is None:
            (tmp_path / "textfile" / "hsx-recover.prom").unlink(missing_ok=True)
        run = _guard(tmp_path, failures, *args)
        assert run.returncode == 0 and "changed=0" in run.stdout, (failures, args, run.stdout[-3000:])


def test_the_give_up_threshold_is_one_number_everywhere() -> None:
    """The alert rules' threshold, the rulebook's and the wrapper's default, recover.yml's guard: all 3."""
    rules = (REPO / "roles/monitoring/files/hsx-selfheal.rules.yml").read_text()
    assert re.findall(r"hsx_recover_automatic_failures >= (\d+)", rules) == ["3"] * 4
    for path in ("extensions/eda/rulebooks/selfheal.yml", "extensions/eda/playbooks/selfheal_remedy.yml",
                 "playbooks/shared/selfheal_guard.yml"):
        found = set(re.findall(r"hsx_selfheal_max_failures \| default\((\d+)\)", (REPO / path).read_text()))
        assert found == {"3"}, (path, found)
