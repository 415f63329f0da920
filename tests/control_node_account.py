"""Running a playbook as an unprivileged account on the control node (issue #39 item 5).

The account (tests/integration/conftest.py's fixture `operator`: a fresh local user, no sudo here)
gets its own copy of the checkout, the lab's inventory with its own copies of the lab key and
known_hosts, and an ansible-playbook it can run. `run_as_operator` runs one playbook that way;
`owned_by_root` lists what, under the account's home (the checkout copy included), root owns after.
Used by test_control_node_user.py (recover.yml, provision.yml) and test_rollout.py (rollout_patch.yml).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import yaml
from labctl import BIN, REPO, _lab_module

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
    shutil.copytree(checkout / "inventory" / "lab" / "group_vars", inventory / "group_vars")
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


def run_as_operator(account: pwd.struct_passwd, home: Path, *args: str,
                    timeout: int = 1200) -> subprocess.CompletedProcess:
    """ansible-playbook `args` run as the account from its copy of the checkout (cwd), on the lab's
    inventory (-i given here), in a clean environment (HOME, USER, PATH only; no ssh master kept).
    Files the run needs besides the checkout go under `home` before the call (it is chowned here)."""
    checkout = home / "hsx"
    copy_checkout(checkout)
    inventory = operator_inventory(checkout, home / ".ssh")
    ansible_playbook = controller(home)
    subprocess.run(["chown", "-R", f"{account.pw_uid}:{account.pw_gid}", str(home)], check=True)
    return subprocess.run(
        ["runuser", "-u", OPERATOR, "--", "env", "-i", f"HOME={home}", f"USER={OPERATOR}",
         f"PATH={ansible_playbook.parent}:/usr/bin:/bin", "ANSIBLE_NOCOLOR=1", "ANSIBLE_FORCE_COLOR=0",
         "ANSIBLE_SSH_ARGS=-o ControlMaster=no", str(ansible_playbook), "-i", str(inventory), *args],
        cwd=checkout, capture_output=True, text=True, timeout=timeout)


def owned_by_root(home: Path) -> list[str]:
    """Paths under `home` (the checkout copy included) that root owns."""
    return [str(p) for p in home.rglob("*") if p.lstat().st_uid == 0]
