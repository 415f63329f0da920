"""Helpers for tests that drive the real lab and real ansible-playbook runs."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAB = REPO / "tests" / "lab" / "lab.py"
BIN = Path(sys.executable).parent
# The lab's wheelhouse (inventory/lab/group_vars/all/main.yml: hsx_wheelhouse).
WHEELHOUSE = REPO / ".cache" / "wheelhouse"
# ANSIBLE_SSH_ARGS for runs whose hosts lose their link or power mid-task: the connection must end in
# seconds, not in the minute ansible.cfg's production keepalives allow.
KEEPALIVE_SSH_ARGS = "-o ControlMaster=auto -o ControlPersist=60s -o ServerAliveInterval=2 -o ServerAliveCountMax=3"


def host(index: int) -> str:
    """The name of lab host `index` in this lab (HSX_LAB_ID selects a parallel lab)."""
    return f"hsxlab{os.environ.get('HSX_LAB_ID', '')}-{index}"


def lab(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LAB), *args], capture_output=True, text=True, check=check)


def lab_ssh(host: str, command: str) -> subprocess.CompletedProcess:
    """`lab.py ssh HOST COMMAND` without a Python started for it: ssh with lab.py's options from this
    process (tests poll hosts with it: a Python started and lab.py imported per call cost ~0.35 s of
    CPU, seen in make test's process accounting). An unknown host: rc 1, lab.py's message on stderr."""
    mod = _lab_module()
    try:
        target = mod._named_host(host)
    except mod.LabError as exc:
        return subprocess.CompletedProcess([str(LAB), "ssh", host, command], 1, "", f"lab: error: {exc}\n")
    return subprocess.run([*mod.ssh_base(target), command], capture_output=True, text=True)


@dataclass
class PlaybookRun:
    rc: int
    output: str

    def recap(self) -> dict[str, dict[str, int]]:
        """Per host: ok/changed/unreachable/failed/... counts from the PLAY RECAP."""
        result = {}
        for m in re.finditer(r"^(\S+)\s+:\s+((?:\w+=\d+\s*)+)$", self.output, re.M):
            result[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
        return result


def playbook(*args: str, env: dict[str, str] | None = None, timeout: int = 1200) -> PlaybookRun:
    full_env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", ANSIBLE_FORCE_COLOR="0",
                    ANSIBLE_NOCOLOR="1", **(env or {}))
    proc = subprocess.run([str(BIN / "ansible-playbook"), *args], cwd=REPO, capture_output=True, text=True,
                          env=full_env, timeout=timeout)
    return PlaybookRun(proc.returncode, proc.stdout + proc.stderr)


@functools.cache
def _lab_module():
    """tests/lab/lab.py as a module (its host records and SSH options), loaded once."""
    spec = importlib.util.spec_from_file_location("hsx_lab_tool", LAB)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def lab_push(host: str, local: Path, remote: str) -> None:
    """Copy a local file or directory to a lab host (scp with the lab key)."""
    mod = _lab_module()
    h = mod.load_host(host)
    ssh = mod.ssh_base(h)
    subprocess.run([*ssh, f"mkdir -p {remote}"], check=True, capture_output=True)
    scp_opts = ssh[1:-1]  # ssh's options; scp takes the same
    subprocess.run(["scp", "-r", "-q", *scp_opts, f"{local}/.", f"root@{h.address}:{remote}/"],
                   check=True, capture_output=True)


def lab_fetch(host: str, remote_dir: str, local: Path, *members: str) -> None:
    """Copy members of a directory on a lab host into `local` (tar over ssh)."""
    mod = _lab_module()
    ssh = mod.ssh_base(mod.load_host(host))
    local.mkdir(parents=True, exist_ok=True)
    tar = subprocess.run([*ssh, f"tar -C {remote_dir} -cf - {' '.join(members)}"], capture_output=True, check=True)
    subprocess.run(["tar", "-C", str(local), "-xf", "-"], input=tar.stdout, check=True)


def wait_for(predicate, timeout: float, what: str, context=None, max_interval: float = 4.0):
    """predicate()'s first truthy value; AssertionError naming `what` after timeout s, with `context()`'s
    text (what the test can still show of why: a log's tail) when given. Asked after 1 s, then at intervals
    growing by half up to `max_interval` s: a predicate is often an SSH session and a Python `hsx status`
    on the host (~0.3 CPU-s), and make test's long waits asked once a second cost minutes of its 2 cores.
    A wait whose end is a measured figure passes max_interval=1 (the figure then says 1 s polls)."""
    deadline = time.monotonic() + timeout
    interval = 1.0
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
        interval = min(interval * 1.5, max_interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f"\n{context()}" if context else ""))
