"""Running playbooks as an unprivileged account on the control node (issue #39 item 5).

`operator_account()` makes a fresh local user (no sudo here) with what an operator has on their own
workstation: a copy of the checkout, its own wheelhouse directory (seeded with the root lab's wheels,
so the build stage finds every dependency and needs no network), the lab's inventory with its own
copies of the lab key and known_hosts, and an ansible-playbook it can run whose `hsx` imports the
account's checkout (PYTHONPATH; an editable install of that checkout does the same). Everything the
playbooks run on the control node - the wheelhouse build, the reports, ansible's own files - runs as
that account. `Operator.playbook` runs one playbook that way; `Operator.owned_by_root` lists what,
under the account's home (the checkout copy included), root owns after.
Used by test_incident.py (recover.yml) and test_rollout.py (provision.yml, rollout_patch.yml), each
a real run, not a --check.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from labctl import BIN, REPO, WHEELHOUSE, PlaybookRun, _lab_module

OPERATOR = f"hsxop{os.environ.get('HSX_LAB_ID', '')}"


def copy_checkout(dest: Path) -> None:
    """The project's files (tracked, and untracked ones git does not ignore), as a clone would have them:
    its symbolic links as links (the sglang_patch role's files are links into extraction/sglang/)."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "-co", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = REPO / name
        if src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(src), dest / name)
        elif src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def operator_inventory(checkout: Path, ssh_dir: Path) -> Path:
    """The lab's inventory for the account: its own copies of the lab key and known_hosts."""
    lab = _lab_module()
    data = lab.inventory_data()
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    shutil.copy(data["lab"]["vars"]["ansible_ssh_private_key_file"], ssh_dir / "lab_key")
    shutil.copy(lab.known_hosts_file(), ssh_dir / "known_hosts")
    (ssh_dir / "lab_key").chmod(0o600)
    group_vars = {**data["lab"]["vars"], "ansible_ssh_private_key_file": str(ssh_dir / "lab_key"),
                  "ansible_ssh_common_args": data["lab"]["vars"]["ansible_ssh_common_args"].replace(
                      str(lab.known_hosts_file()), str(ssh_dir / "known_hosts"))}
    inventory = checkout / "inventory" / "operator"
    shutil.copytree(checkout / "inventory" / "lab" / "group_vars", inventory / "group_vars", dirs_exist_ok=True)
    hosts = {name: data["_meta"]["hostvars"][name] for name in data["lab"]["hosts"]}
    (inventory / "hosts.yml").write_text(yaml.safe_dump({"extraction_nodes": {"hosts": hosts, "vars": group_vars}}))
    return inventory / "hosts.yml"


def controller(home: Path) -> Path:
    """The account's ansible-playbook. The project's venv when the account can run its Python; else
    (a venv made from a Python under root's 0700 home, pyenv) a venv of the account's own from the
    system's Python of the same version, seeing the project venv's packages, with the same scripts."""
    probe = subprocess.run(["runuser", "-u", OPERATOR, "--", str(BIN / "python"), "-c", ""], capture_output=True)
    if probe.returncode == 0:
        return BIN / "ansible-playbook"
    system = Path("/usr/bin") / f"python{sysconfig.get_python_version()}"
    if not system.is_file():
        pytest.skip(f"{BIN / 'python'} cannot run as {OPERATOR} and there is no {system}")
    venv = home / "venv"
    subprocess.run([str(system), "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    (purelib,) = venv.glob("lib/python*/site-packages")
    (purelib / "hsx-project-venv.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    for name in ("ansible-playbook", "hsx"):
        lines = (BIN / name).read_text().splitlines(keepends=True)
        (venv / "bin" / name).write_text(f"#!{venv / 'bin' / 'python'}\n" + "".join(lines[1:]))
        (venv / "bin" / name).chmod(0o755)
    return venv / "bin" / "ansible-playbook"


@dataclass
class Operator:
    """The account, its home, its checkout (the playbooks' cwd) and its ansible-playbook."""

    account: pwd.struct_passwd
    home: Path
    checkout: Path
    ansible_playbook: Path

    @property
    def reports(self) -> Path:
        """Where the playbooks write their reports by default (the checkout's reports/)."""
        return self.checkout / "reports"

    def give(self, path: Path) -> Path:
        """A file or tree a test put under the home for a run (an -e @file) becomes the account's."""
        subprocess.run(["chown", "-R", f"{self.account.pw_uid}:{self.account.pw_gid}", str(path)], check=True)
        return path

    def playbook(self, *args: str, timeout: int = 1200) -> PlaybookRun:
        """ansible-playbook `args` as the account, from its checkout, on the lab's inventory (its hosts
        now), in a clean environment (HOME, USER, PATH, PYTHONPATH only; its ssh masters end with the account)."""
        inventory = operator_inventory(self.checkout, self.home / ".ssh")
        self.give(inventory.parent)
        self.give(self.home / ".ssh")
        env = [f"HOME={self.home}", f"USER={OPERATOR}", f"PATH={self.ansible_playbook.parent}:/usr/bin:/bin",
               f"PYTHONPATH={self.checkout}:{self.checkout / 'module_utils'}",
               "ANSIBLE_NOCOLOR=1", "ANSIBLE_FORCE_COLOR=0"]
        proc = subprocess.run(
            ["runuser", "-u", OPERATOR, "--", "env", "-i", *env, str(self.ansible_playbook),
             "-i", str(inventory), *args],
            cwd=self.checkout, capture_output=True, text=True, timeout=timeout)
        return PlaybookRun(proc.returncode, proc.stdout + proc.stderr)

    def owned_by_root(self) -> list[str]:
        """Paths under the home (the checkout copy included) that root owns."""
        return [str(p) for p in self.home.rglob("*") if p.lstat().st_uid == 0]


@contextlib.contextmanager
def operator_account() -> Iterator[Operator]:
    """A fresh account (OPERATOR) set up as above; removed with its home afterwards."""
    home = Path("/home") / OPERATOR
    subprocess.run(["userdel", "--remove", OPERATOR], capture_output=True)  # a run killed before its teardown
    subprocess.run(["useradd", "--create-home", "--home-dir", str(home), "--shell", "/bin/sh", OPERATOR],
                   check=True, capture_output=True)
    account = pwd.getpwnam(OPERATOR)
    try:
        checkout = home / "hsx"
        copy_checkout(checkout)
        subprocess.run([str(BIN / "hsx"), "wheelhouse", str(WHEELHOUSE)], check=True, capture_output=True)
        # The lab inventory's hsx_wheelhouse is the checkout's .cache/wheelhouse: seeded with the root
        # lab's wheels, its manifest without the sources' digest, so that the account's first build
        # stage really builds (`pip wheel` of its checkout, then finds every dependency present).
        wheels = checkout / ".cache" / "wheelhouse"
        shutil.copytree(WHEELHOUSE, wheels, ignore=shutil.ignore_patterns(".lock"))
        manifest = json.loads((wheels / "wheelhouse.json").read_text())
        del manifest["source_digest"]
        (wheels / "wheelhouse.json").write_text(json.dumps(manifest))
        operator = Operator(account, home, checkout, controller(home))
        operator.give(home)
        yield operator
    finally:
        # Only the tests ran anything as the fresh account: what is left (an ssh master) is ours to end,
        # and userdel refuses while any of it still runs ("currently used by process N": a SIGTERMed
        # ssh master had not exited yet, test_rollout 2026-12-07): wait for it, then SIGKILL.
        def left() -> list[str]:
            ps = subprocess.run(["ps", "-o", "pid=", "-u", str(account.pw_uid)], capture_output=True, text=True)
            return ps.stdout.split()

        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in left():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), sig)
            deadline = time.monotonic() + 10
            while left() and time.monotonic() < deadline:
                time.sleep(0.2)
        gone = subprocess.run(["userdel", "--remove", OPERATOR], capture_output=True, text=True)
        assert gone.returncode == 0, f"userdel {OPERATOR}: {gone.stderr}"
