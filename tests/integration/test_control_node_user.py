"""Issue #39 item 5: recover.yml and provision.yml from a normal account on the control node, sudo on the targets only.

An unprivileged local account (no sudo here) with its own copy of the checkout runs the assessment
(`recover.yml --check` and `playbooks/provision.yml --check`, the stages that build nothing) against one lab host. Everything the run
does on the control node (the target check, the report, ansible's own files) runs as that account:
the run succeeds, and nothing under its home (the checkout copy included) is owned by root. Before
the plays' localhost tasks set `become: false`, the report's tasks asked for sudo here and failed.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sysconfig
from pathlib import Path

import pytest
import yaml
from labctl import BIN, REPO, _lab_module

USER = f"hsxop{os.environ.get('HSX_LAB_ID', '')}"


@pytest.fixture
def operator():
    """A fresh local account without sudo, removed with its home afterwards."""
    home = Path("/home") / USER
    subprocess.run(["userdel", "--remove", USER], capture_output=True)  # a run killed before its teardown
    subprocess.run(["useradd", "--create-home", "--home-dir", str(home), "--shell", "/bin/sh", USER],
                   check=True, capture_output=True)
    account = pwd.getpwnam(USER)
    try:
        yield account, home
    finally:
        # Only this test ran anything as the fresh account: what is left (an ssh master) is ours to end.
        left = subprocess.run(["ps", "-o", "pid=", "-u", str(account.pw_uid)], capture_output=True, text=True)
        for pid in left.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGTERM)
        gone = subprocess.run(["userdel", "--remove", USER], capture_output=True, text=True)
        assert gone.returncode == 0, f"userdel {USER}: {gone.stderr}"


def copy_checkout(dest: Path) -> None:
    """The project's files (tracked, and untracked ones git does not ignore), as a clone would have them."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "-co", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = REPO / name
        if src.is_file() and not src.is_symlink():
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
    shutil.copytree(checkout / "inventory" / "lab" / "group_vars", inventory / "group_vars")
    hosts = {name: data["_meta"]["hostvars"][name] for name in data["lab"]["hosts"]}
    (inventory / "hosts.yml").write_text(yaml.safe_dump({"extraction_nodes": {"hosts": hosts, "vars": group_vars}}))
    return inventory / "hosts.yml"


def controller(home: Path) -> Path:
    """The account's ansible-playbook. The project's venv when the account can run its Python; else
    (a venv made from a Python under root's 0700 home, pyenv) a venv of the account's own from the
    system's Python of the same version, seeing the project venv's packages, with the same scripts."""
    probe = subprocess.run(["runuser", "-u", USER, "--", str(BIN / "python"), "-c", ""], capture_output=True)
    if probe.returncode == 0:
        return BIN / "ansible-playbook"
    system = Path("/usr/bin") / f"python{sysconfig.get_python_version()}"
    if not system.is_file():
        pytest.skip(f"{BIN / 'python'} cannot run as {USER} and there is no {system}")
    venv = home / "venv"
    subprocess.run([str(system), "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    (purelib,) = venv.glob("lib/python*/site-packages")
    (purelib / "hsx-project-venv.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    for name in ("ansible-playbook", "hsx"):
        lines = (BIN / name).read_text().splitlines(keepends=True)
        (venv / "bin" / name).write_text(f"#!{venv / 'bin' / 'python'}\n" + "".join(lines[1:]))
        (venv / "bin" / name).chmod(0o755)
    return venv / "bin" / "ansible-playbook"


# The stages that build nothing (the wheelhouse build would need the root account's package caches):
# what runs on the control node (the target check, the report, ansible's own files) is the same in
# every stage. rollout_patch.yml is not here: its preflight needs an SGLang planted on the host.
PLAYBOOKS = {
    "recover.yml": "deploy,patch,server,job",
    "playbooks/provision.yml": "deploy,patch,server,job,monitoring",
}


@pytest.mark.parametrize("play", sorted(PLAYBOOKS))
def test_a_play_checked_as_a_normal_user_leaves_nothing_owned_by_root(lab_hosts, operator, play):
    account, home = operator
    checkout = home / "hsx"
    copy_checkout(checkout)
    inventory = operator_inventory(checkout, home / ".ssh")
    ansible_playbook = controller(home)
    subprocess.run(["chown", "-R", f"{account.pw_uid}:{account.pw_gid}", str(home)], check=True)

    proc = subprocess.run(
        ["runuser", "-u", USER, "--", "env", "-i", f"HOME={home}", f"USER={USER}", f"PATH={ansible_playbook.parent}:/usr/bin:/bin",
         "ANSIBLE_NOCOLOR=1", "ANSIBLE_FORCE_COLOR=0",
         "ANSIBLE_SSH_ARGS=-o ControlMaster=no", str(ansible_playbook), "-i", str(inventory),
         play, "--check", "--skip-tags", PLAYBOOKS[play]],
        cwd=checkout, capture_output=True, text=True, timeout=1200)
    out = proc.stdout + proc.stderr

    assert proc.returncode == 0, out[-4000:]
    assert f"{lab_hosts[0]}" in out and "failed=0" in out.split("PLAY RECAP")[-1], out[-3000:]
    (summary,) = (checkout / "reports").glob("*/summary.md")
    assert summary.stat().st_uid == account.pw_uid
    owned_by_root = [str(p) for p in home.rglob("*") if p.lstat().st_uid == 0]
    assert not owned_by_root, owned_by_root[:20]
