"""Issue #30 item 7: SSH host keys are checked. ansible.cfg leaves Ansible's host key checking on, and
no inventory turns it off; the lab pins its hosts' keys (read from their root filesystems on the
control node) in a known_hosts file of its own, named in the `lab` group's variables only.
"""

from __future__ import annotations

import configparser
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("lab", ROOT / "tests" / "lab" / "lab.py")
lab = importlib.util.module_from_spec(_spec)
sys.modules["lab"] = lab  # dataclasses look their module up by name
_spec.loader.exec_module(lab)

OFF = ("StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "StrictHostKeyChecking=accept-new")
ED25519 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHsxk3pBvN0pqjV7mRGZ0m1z0F4e5UjWcVv6b5o3m3xX"
ECDSA = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBGdummy="


def test_ansible_cfg_does_not_turn_host_key_checking_off():
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "ansible.cfg")
    assert cfg.getboolean("defaults", "host_key_checking", fallback=True) is True
    for section in cfg.sections():
        for key, value in cfg.items(section):
            assert not any(o.lower() in value.lower() for o in OFF), f"[{section}] {key} = {value}"


def test_ansible_resolves_host_key_checking_on_from_the_file():
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env["ANSIBLE_CONFIG"] = str(ROOT / "ansible.cfg")
    out = subprocess.run([str(Path(sys.executable).parent / "ansible-config"), "dump", "--format", "json"],
                         env=env, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    setting = next(e for e in json.loads(out) if e["name"] == "HOST_KEY_CHECKING")
    assert setting["value"] is True, setting


def test_no_inventory_file_turns_checking_off():
    for path in sorted((ROOT / "inventory").rglob("*")):
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            assert "host_key_checking" not in text, path
            assert not any(o in text for o in OFF), path


def _running_host(tmp_path, monkeypatch, index: int = 1, keys: tuple[str, ...] = (ED25519,)):
    """A lab host as inventory_data() sees one: its merged root fs holds its host keys."""
    monkeypatch.setattr(lab, "STATE", tmp_path)
    host = lab.Host.make(index, "rw", "512M")
    ssh = host.dir / "merged" / "etc" / "ssh"
    ssh.mkdir(parents=True)
    for key in keys:
        (ssh / f"ssh_host_{key.split()[0].split('-')[-1]}_key.pub").write_text(f"{key} root@builder\n")
    (ssh / "ssh_host_ed25519_key").write_text("PRIVATE - never read\n")
    return host


def test_lab_pins_its_hosts_keys_in_the_lab_group_only(tmp_path, monkeypatch):
    hosts = [_running_host(tmp_path, monkeypatch, 1, (ED25519, ECDSA)), _running_host(tmp_path, monkeypatch, 2)]
    monkeypatch.setattr(lab, "lab_hosts", lambda: hosts)
    data = lab.inventory_data()
    # no `all` vars: nothing reaches hosts of another inventory; the plays' target group holds the lab
    assert set(data) == {"lab", "extraction_nodes", "_meta"}
    assert data["extraction_nodes"] == {"children": ["lab"]}
    group = data["lab"]["vars"]
    assert group.get("ansible_host_key_checking", True) is True and "ansible_ssh_host_key_checking" not in group
    args = group["ansible_ssh_common_args"]
    assert not any(o in args for o in OFF), args
    assert "StrictHostKeyChecking=yes" in args
    known = Path(re.search(r"UserKnownHostsFile=(\S+)", args).group(1))
    lines = known.read_text().splitlines()
    assert sorted(lines) == sorted([f"{hosts[0].address} {ED25519}", f"{hosts[0].address} {ECDSA}",
                                    f"{hosts[1].address} {ED25519}"])
    assert "PRIVATE" not in known.read_text()
    # lab.py's own ssh (lab.py ssh, labctl's ssh and scp) checks against the same file
    base = lab.ssh_base(hosts[0])
    assert f"UserKnownHostsFile={known}" in base and "StrictHostKeyChecking=yes" in base
    assert not any(o in " ".join(base) for o in OFF)


def test_known_hosts_follows_the_labs_hosts(tmp_path, monkeypatch):
    first = _running_host(tmp_path, monkeypatch, 1)
    monkeypatch.setattr(lab, "lab_hosts", lambda: [first])
    args = lab.inventory_data()["lab"]["vars"]["ansible_ssh_common_args"]
    known = Path(re.search(r"UserKnownHostsFile=(\S+)", args).group(1))
    assert known.read_text() == f"{first.address} {ED25519}\n"
    monkeypatch.setattr(lab, "lab_hosts", lambda: [])
    lab.inventory_data()
    assert known.read_text() == ""
