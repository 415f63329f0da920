"""The README's systemd unit for the self-healing rulebook runs as printed (issue #50 item 7): its
ExecStart, with exactly its Environment= lines on top of the environment systemd gives a system
service (no login shell's PATH: the failure this guards against was "ansible-galaxy is not installed",
the venv's bin missing from PATH), in its WorkingDirectory, starts ansible-rulebook and opens the
webhook; the commands the remedies run (ansible-playbook, hsx) are found on that PATH.

This machine has no systemd as PID 1 (no `systemd-run`), so the test builds the service's environment
as systemd does for `User=` (PATH /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin, HOME, USER,
LOGNAME, SHELL) - a stand-in for systemd's exec step - with the unit's paths under /home/operator/hsx
moved to this checkout, and one addition to its command line: `--vars` with a free port and a state
directory in the test's tmp (the unit's default port 5050 may be taken here)."""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNIT_PATH = "/etc/systemd/system/hsx-selfheal.service"
OPERATOR_CHECKOUT = "/home/operator/hsx"
# What systemd puts in a system service's environment before its Environment= lines (systemd.exec(5)).
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"


def readme_unit() -> dict[str, list[str]]:
    """The README's unit: {key: [values in order]} of its [Service] section, continuation lines joined."""
    text = (REPO / "README.md").read_text()
    m = re.search(r"```ini\n# " + re.escape(UNIT_PATH) + r"\n(.*?)```", text, re.S)
    assert m, f"README.md has no ```ini block starting with '# {UNIT_PATH}'"
    body = m.group(1).replace("\\\n", " ")
    section, service = "", {}
    for line in body.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            key, _, value = line.partition("=")
            service.setdefault(key, []).append(value)
    return service


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_readmes_rulebook_unit_starts_with_its_own_environment(tmp_path: Path) -> None:
    service = readme_unit()
    here = lambda v: v.replace(OPERATOR_CHECKOUT, str(REPO))  # noqa: E731
    me = pwd.getpwuid(os.getuid())
    env = {"PATH": SYSTEMD_PATH, "HOME": me.pw_dir, "USER": me.pw_name, "LOGNAME": me.pw_name, "SHELL": me.pw_shell}
    for assignment in service.get("Environment", []):
        key, _, value = shlex.split(assignment)[0].partition("=")
        env[key] = here(value)
    if not Path(env.get("JAVA_HOME", "/nonexistent")).is_dir():
        pytest.skip(f"the unit's JAVA_HOME {env.get('JAVA_HOME')} is not on this machine (openjdk-17-jre-headless)")
    inventory = tmp_path / "inventory.yml"
    inventory.write_text("all:\n  children:\n    extraction_nodes:\n      hosts:\n        gpu-node-07:\n")
    assert env.get("ANSIBLE_INVENTORY") == f"{REPO}/inventory/mine", env
    env["ANSIBLE_INVENTORY"] = str(inventory)  # the operator's inventory folder: this test's
    # The commands ansible-rulebook and its remedies run, found where the unit's PATH says.
    for command in ("ansible-galaxy", "ansible-playbook", "hsx", "java"):
        assert shutil.which(command, path=env["PATH"]), f"{command} is not on the unit's PATH {env['PATH']}"
    port = free_port()
    (tmp_path / "vars.json").write_text(json.dumps({"hsx_selfheal_port": port,
                                                    "hsx_selfheal_state_dir": str(tmp_path / "state"),
                                                    "hsx_selfheal_textfile_dir": str(tmp_path)}))
    (exec_start,) = service["ExecStart"]
    argv = [here(a) for a in shlex.split(exec_start)] + ["--vars", str(tmp_path / "vars.json")]
    (workdir,) = service["WorkingDirectory"]
    log = tmp_path / "rulebook.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=here(workdir), env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert proc.poll() is None, f"the unit's ExecStart exited {proc.returncode}: {log.read_text()[-2000:]}"
                assert time.monotonic() < deadline, f"no webhook after 90 s: {log.read_text()[-2000:]}"
                time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
