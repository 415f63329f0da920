"""The self-healing rulebook's decisions (extensions/eda/rulebooks/selfheal.yml), by the real
ansible-rulebook (drools on Java): Alertmanager's webhook payloads posted to its webhook source; which
remedy runs on which host is recorded by stand-in remedy playbooks (a checkout whose recover.yml and
playbooks/takeover.yml only write down what they were asked to do, on localhost connections), which
the real remedy wrapper (extensions/eda/playbooks/selfheal_remedy.yml) runs in place. Alertmanager's payload
shape: DESIGN.md section 10. The lab test (tests/integration/test_self_healing.py) runs the real
recover.yml end to end; this one is also the takeover rule's only test (its playbook is another issue's)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
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


def post(port: int, *alerts: dict, token: str | None = None) -> int:
    """One notification as Alertmanager's webhook receiver sends it (version 4); the HTTP status."""
    body = {"version": "4", "status": alerts[0]["status"], "receiver": "hsx-selfheal", "alerts": list(alerts),
            "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://am", "groupKey": "k"}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    req = urllib.request.Request(f"http://127.0.0.1:{port}/alerts", data=json.dumps(body).encode(), headers=headers)
    try:
        # 60 s: on a loaded machine (load 20 on 2 cores) the rulebook, still starting, left the first post
        # unanswered for more than 10 s after its port opened.
        with opener.open(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


RECORDER_SLOW = """
- name: Stand-in remedy ({what}), writing down when it ran
  hosts: {hosts}
  connection: local
  gather_facts: false
  tasks:
    - name: Record the start, take a while, record the end
      ansible.builtin.shell: "echo \\"start {what} $(date +%s.%N)\\" >> {times}; sleep 3; echo \\"end {what} $(date +%s.%N)\\" >> {times}; echo '{what} {{{{ {who} }}}} {{{{ hsx_selfheal }}}} {{{{ hsx_report_dir }}}}' >> {record}"
      changed_when: true
      run_once: true
"""
SOURCES = REPO / "extensions" / "eda" / "plugins" / "event_source"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_collection(tmp_path: Path) -> Path:
    """The collection as a user gets it: tools/collection/build.py's tarball, installed by ansible-galaxy
    into a fresh collections path (returned)."""
    spec = importlib.util.spec_from_file_location("hsx_collection_build", REPO / "tools" / "collection" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    tarball = build.build_tarball(build.build(tmp_path / "build"), tmp_path / "build" / "dist")
    colls = tmp_path / "collections"
    # --force, and outside the checkout: its ansible.cfg's collections path has an hsx.recovery (a link).
    subprocess.run([str(BIN / "ansible-galaxy"), "collection", "install", "--offline", "--force", "-p", str(colls),
                    str(tarball)], check=True, capture_output=True, cwd=tmp_path)
    return colls


def start_rulebook(tmp_path: Path, hosts: list[str], rulebook_vars: dict, *, slow: bool = False,
                   window: str | None = None, installed: Path | None = None) -> tuple[subprocess.Popen, Path]:
    """The real rulebook (optionally with a shorter throttle window) whose remedies are stand-ins in a
    temporary checkout; the real wrapper, `hsx selfheal remedy` and extensions/eda/playbooks/selfheal_verify.yml.
    `installed` (a collections path holding hsx.recovery, install_collection): the installed rulebook
    instead, `-r hsx.recovery.selfheal` with no checkout and no ansible.cfg, its wrapper and verification
    by FQCN, whose hsx.recovery.recover and hsx.recovery.takeover are replaced there by the stand-ins.
    `hosts`: the extraction nodes, on local connections, but for names ending in "-down": SSH to a
    closed port of this machine (they do not answer)."""
    if not shutil.which("java") and not os.environ.get("JAVA_HOME"):
        pytest.skip("no Java runtime (make lab-ensure installs openjdk-17-jre-headless)")
    project, record = tmp_path / "checkout", tmp_path / "record.txt"
    (project / "extensions" / "eda" / "playbooks").mkdir(parents=True)
    (project / "playbooks").mkdir()
    shutil.copy(REPO / "extensions" / "eda" / "playbooks" / "selfheal_remedy.yml",
                project / "extensions" / "eda" / "playbooks")
    shutil.copy(REPO / "extensions" / "eda" / "playbooks" / "selfheal_verify.yml", project / "extensions" / "eda" / "playbooks")
    recorder = RECORDER_SLOW if slow else RECORDER
    times = tmp_path / "times.txt"
    remedies = installed / "ansible_collections" / "hsx" / "recovery" / "playbooks" if installed else project
    (remedies / "recover.yml").write_text(recorder.format(what="recover", hosts="all", who="ansible_limit",
                                                          record=record, times=times))
    (remedies / ("takeover.yml" if installed else "playbooks/takeover.yml")).write_text(
        recorder.format(what="takeover", hosts="localhost", who="hsx_takeover_host", record=record, times=times))
    (project / "ansible.cfg").write_text(f"[defaults]\nroles_path = {REPO / 'roles'}\nlibrary = {REPO / 'library'}\n"
                                         f"module_utils = {REPO / 'module_utils'}\nfilter_plugins = {REPO / 'filter_plugins'}\n"
                                         "timeout = 5\n")
    closed = free_port()
    lines = ["[extraction_nodes]"] + [
        f"{h} ansible_connection=ssh ansible_host=127.0.0.1 ansible_port={closed}" if h.endswith("-down")
        else f"{h} ansible_connection=local" for h in hosts]
    (tmp_path / "hosts.ini").write_text("\n".join(lines) + f"\n[all:vars]\nansible_python_interpreter={sys.executable}\n"
                                        f"hsx_become=false\nhsx_output_dir={tmp_path / 'output'}\n")
    port = free_port()
    env = dict(os.environ, HSX_PROJECT_DIR=str(project), ANSIBLE_INVENTORY=str(tmp_path / "hosts.ini"),
               PATH=f"{BIN}:{os.environ['PATH']}", ANSIBLE_LOCALHOST_WARNING="0")
    if installed:
        del env["HSX_PROJECT_DIR"]
        env["ANSIBLE_COLLECTIONS_PATH"] = str(installed)
    (tmp_path / "vars.yml").write_text(json.dumps({"hsx_selfheal_port": port, "hsx_selfheal_settle": 0,
                                                   "hsx_selfheal_state_dir": str(tmp_path / "state"),
                                                   "hsx_selfheal_textfile_dir": str(tmp_path), **rulebook_vars}))
    book = RULEBOOK.read_text()
    if window:
        assert "once_within: 15 minutes" in book
        book = book.replace("once_within: 15 minutes", f"once_within: {window}")
    (tmp_path / "selfheal.yml").write_text(book)
    log = open(tmp_path / "rulebook.log", "wb")  # noqa: SIM115 - the process's, closed with it
    argv = (["-r", "hsx.recovery.selfheal", "-E", "ANSIBLE_INVENTORY"] if installed else
            ["-r", str(tmp_path / "selfheal.yml"), "-S", str(SOURCES), "-E", "HSX_PROJECT_DIR,ANSIBLE_INVENTORY"])
    proc = subprocess.Popen([str(BIN / "ansible-rulebook"), *argv, "--vars", str(tmp_path / "vars.yml")],
                            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_file = log  # type: ignore[attr-defined]
    deadline = time.monotonic() + 90
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if proc.poll() is not None:
                return proc, record
            assert time.monotonic() < deadline, "the rulebook's webhook did not open in 90 s"
            time.sleep(0.5)
    proc.port = port  # type: ignore[attr-defined]
    return proc, record


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=30)
    proc.log_file.close()  # type: ignore[attr-defined]


@pytest.fixture
def rulebook(tmp_path: Path):
    # The remedies this test asks for at once (3 hosts of 3) are not taken for a storm: test_breaker_* is.
    proc, record = start_rulebook(tmp_path, ["node-1", "node-2-down", "node-3"], {"hsx_selfheal_breaker_min_nodes": 4})
    try:
        yield proc.port, record, tmp_path / "rulebook.log"  # type: ignore[attr-defined]
    finally:
        stop(proc)


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
    # Not acted on: a "host" that is a pattern, a group, a name with a trailing newline, a host outside
    # extraction_nodes; a takeover of a node that answers (its claim does not hold).
    post(port, alert("firing", "node-*", "recover"))
    post(port, alert("firing", "extraction_nodes", "takeover", "HsxSelfHealNodeDown"))
    post(port, alert("firing", "all", "recover"))
    post(port, alert("firing", "localhost", "recover"))
    post(port, alert("firing", "node-3\n", "recover"))
    post(port, alert("firing", "node-9", "recover"))
    post(port, alert("firing", "node-3", "takeover", "HsxSelfHealNodeDown"))
    # Acted on: one notification of two alerts, split into two events.
    post(port, alert("firing", "node-1", "recover"), alert("firing", "node-2-down", "takeover", "HsxSelfHealNodeDown"))
    lines = wait_lines(record, 2, timeout=240)  # the takeovers run one at a time, each verified first
    # Within the window: the same remedy for the same host again is ignored.
    post(port, alert("firing", "node-1", "recover"))
    post(port, alert("firing", "node-2-down", "takeover", "HsxSelfHealNodeDown"))
    time.sleep(8)
    lines = record.read_text().splitlines()
    assert sorted(lines) == [f"recover node-1 True {project}/reports", f"takeover node-2-down True {project}/reports"], \
        log.read_text()[-4000:]
    # node-3's takeover waits for node-2-down's (one takeover at a time), then is verified: its finding
    # comes last (after 8 s it had none yet on a loaded make test).
    deadline = time.monotonic() + 120
    while True:
        state = json.loads((record.parent / "state" / "ledger.json").read_text())
        findings = {(r["host"], r["remedy"]): r.get("finding", "") for r in state["requests"]}
        if all(findings.values()) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert findings[("node-3", "takeover")].startswith("not-confirmed: node-3 answers over SSH"), findings
    assert findings[("node-2-down", "takeover")].startswith("unreachable: node-2-down answers neither"), findings
    assert findings[("node-1", "recover")].startswith("confirmed: node-1's job is not making progress"), findings
    assert {r["host"] for r in state["requests"]} == {"node-1", "node-2-down", "node-3"}  # node-9 refused before
    assert 'hsx_selfheal_breaker_open 0' in (record.parent / "hsx-selfheal.prom").read_text()


def test_breaker_a_storm_runs_nothing_until_a_person_resumes(tmp_path: Path) -> None:
    """Every node of a fleet asks at once (shared storage full): no remedy runs, the breaker opens and
    says why; `hsx selfheal resume` closes it and the same alerts, posted again, are healed once each.
    A takeover is never run beside another remedy."""
    hosts = ["node-1", "node-2", "node-3-down"]
    proc, record = start_rulebook(tmp_path, hosts, {"hsx_selfheal_settle": 4}, slow=True, window="3 seconds")
    try:
        port = proc.port  # type: ignore[attr-defined]
        post(port, *[alert("firing", h, "recover") for h in hosts])
        state_file = tmp_path / "state" / "ledger.json"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            state = json.loads(state_file.read_text()) if state_file.exists() else {}
            if len(state.get("outcomes", [])) == 3:
                break
            time.sleep(0.5)
        assert [o["outcome"] for o in state["outcomes"]] == ["held"] * 3, (state, (tmp_path / "rulebook.log").read_text()[-3000:])
        assert "3 of 3 extraction nodes asked for a remedy" in state["breaker"]["why"]
        assert not record.exists()
        prom = (tmp_path / "hsx-selfheal.prom").read_text()
        assert re.search(r'hsx_selfheal_breaker_open\{cause="unknown",hosts="node-1,node-2,node-3-down",alerts="HsxSelfHealStalled"', prom), prom
        status = subprocess.run([str(BIN / "hsx"), "selfheal", "status", "--state-dir", str(tmp_path / "state")],
                                capture_output=True, text=True)
        assert status.returncode == 1 and "BREAKER OPEN" in status.stdout and "hsx selfheal resume" in status.stdout
        resume = subprocess.run([str(BIN / "hsx"), "selfheal", "resume", "--state-dir", str(tmp_path / "state")],
                                capture_output=True, text=True)
        assert resume.returncode == 0 and "breaker closed" in resume.stdout, resume
        assert "hsx_selfheal_breaker_open 0" in (tmp_path / "hsx-selfheal.prom").read_text()  # where the loop wrote it
        # Alertmanager re-posts the still-firing alerts; a takeover asked at the same time waits its turn.
        post(port, *[alert("firing", h, "recover") for h in hosts[:2]],
             alert("firing", "node-3-down", "takeover", "HsxSelfHealNodeDown"))
        lines = wait_lines(record, 3, timeout=120)
    finally:
        stop(proc)
    assert sorted(lines) == [f"recover node-{i} True {tmp_path}/checkout/reports" for i in (1, 2)] + \
        [f"takeover node-3-down True {tmp_path}/checkout/reports"], lines
    times = [line.split() for line in (tmp_path / "times.txt").read_text().splitlines()]
    spans, open_ = [], {}
    for kind, what, at in times:
        if kind == "start":
            open_.setdefault(what, []).append(float(at))
        else:
            spans.append((what, open_[what].pop(0), float(at)))
    (t0, t1), = [(a, b) for w, a, b in spans if w == "takeover"]
    assert len(spans) == 3 and all(w == "takeover" or b <= t0 or a >= t1 for w, a, b in spans), spans


def test_webhook_posts_need_the_token_and_beyond_loopback_one_is_required(tmp_path: Path) -> None:
    """Also self-healing from the installed collection (issue #50 item 4): this rulebook is
    hsx.recovery.selfheal from the built tarball, with no checkout and no ansible.cfg: its remedy wrapper
    hsx.recovery.selfheal_remedy and verification hsx.recovery.selfheal_verify by FQCN, the recovery
    hsx.recovery.recover (the stand-in, in its place), reports in the state directory."""
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    installed = install_collection(tmp_path)
    proc, record = start_rulebook(tmp_path, ["node-1", "node-2"], {"hsx_selfheal_token_file": str(token)},
                                  installed=installed)
    try:
        port = proc.port  # type: ignore[attr-defined]
        assert post(port, alert("firing", "node-1", "recover")) == 401
        assert post(port, alert("firing", "node-1", "recover"), token="wrong") == 401
        assert post(port, alert("firing", "node-1", "recover"), token="s3cret-token") == 200
        # Verification and recovery are two ansible-playbook runs: minutes on a loaded machine.
        assert wait_lines(record, 1, timeout=180) == [f"recover node-1 True {tmp_path}/state/reports"], \
            (tmp_path / "rulebook.log").read_text()[-4000:]
        deadline, state = time.monotonic() + 60, {}
        while not state.get("outcomes") and time.monotonic() < deadline:  # recorded once the playbook returned
            time.sleep(0.5)
            state = json.loads((tmp_path / "state" / "ledger.json").read_text())
    finally:
        stop(proc)
    assert state["requests"][0]["finding"].startswith("confirmed: node-1's job is not making progress"), state
    assert [(o["outcome"], o["detail"]) for o in state["outcomes"]] == [("ok", "hsx.recovery.recover rc 0")], state
    # Listening beyond loopback without a token: the rulebook does not start its webhook.
    other = tmp_path / "other"
    other.mkdir()
    proc, _ = start_rulebook(other, ["node-1"], {"hsx_selfheal_listen": "0.0.0.0"})
    try:
        proc.wait(timeout=60)
    finally:
        stop(proc)
    assert "refusing to listen on 0.0.0.0 without authentication" in (other / "rulebook.log").read_text()


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


CONTROLLER = REPO / "extensions" / "eda" / "rulebooks" / "selfheal_controller.yml"


def test_the_controller_variant_has_the_same_rules_and_launches_the_job_template() -> None:
    """selfheal_controller.yml (for an EDA controller): ansible-rulebook's schema accepts it; its rules are
    selfheal.yml's (names, conditions, throttles) with run_job_template for run_playbook, the alert's host
    as the job's limit, the same variables but the checkout's and the inventory (the job template's own)."""
    import yaml
    from ansible_rulebook.validators import Validate

    ours, controller = yaml.safe_load(RULEBOOK.read_text()), yaml.safe_load(CONTROLLER.read_text())
    Validate.rulebook(controller)
    assert list(controller[0]["sources"][0])[1] == "hsx.recovery.hsx_webhook"  # a collection's source, by FQCN
    assert {k: v for k, v in controller[0]["sources"][0].items() if k != "hsx.recovery.hsx_webhook"} == \
        {k: v for k, v in ours[0]["sources"][0].items() if k != "hsx_webhook"}
    assert list(controller[0]["sources"][0].values())[1] == ours[0]["sources"][0]["hsx_webhook"]
    assert len(controller[0]["rules"]) == len(ours[0]["rules"]) == 2
    for mine, theirs in zip(ours[0]["rules"], controller[0]["rules"], strict=True):
        assert {k: mine[k] for k in ("name", "condition", "throttle")} == \
            {k: theirs[k] for k in ("name", "condition", "throttle")}
        book, job = mine["action"]["run_playbook"], theirs["action"]["run_job_template"]
        assert job["lock"] == book["lock"] and job["job_args"]["limit"] == "{{ event.labels.hsx_host }}"
        want = {k: v for k, v in book["extra_vars"].items() if k not in ("hsx_project_dir", "hsx_selfheal_inventory")}
        assert job["job_args"]["extra_vars"] == want


def test_the_wrapper_refuses_a_controller_job_without_a_lasting_ledger(tmp_path: Path) -> None:
    """In an automation controller's job (awx_job_id set) the wrapper runs nothing without
    hsx_selfheal_state_dir: the job's home, where the ledger would go, is gone with its container."""
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_LOCALHOST_WARNING="0")
    args = {"awx_job_id": 7, "hsx_selfheal_remedy": "recover", "hsx_selfheal_alert": "HsxSelfHealStalled"}
    run = subprocess.run([str(BIN / "ansible-playbook"), "-i", "node-1,", "--limit", "node-1",
                          str(REPO / "extensions/eda/playbooks/selfheal_remedy.yml"), "-e", json.dumps(args)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "hsx_selfheal_state_dir is empty in the automation controller's job 7" in run.stdout, \
        run.stdout[-3000:]
    assert "Brakes, verification" not in run.stdout
