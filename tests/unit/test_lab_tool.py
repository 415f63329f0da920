"""Pure parts of the lab tool (no root needed): mirror discovery (tests/lab/lab_control.py) and naming."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("lab", Path(__file__).resolve().parents[1] / "lab" / "lab.py")
lab = importlib.util.module_from_spec(_spec)
sys.modules["lab"] = lab  # dataclasses look their module up by name
_spec.loader.exec_module(lab)
control = sys.modules["lab_control"]  # lab.py's sibling, imported by it


def test_mirror_from_deb822_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("HSX_LAB_MIRROR", raising=False)
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.invalid/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\nURIs: http://mirror.invalid/debian\nSuites: bookworm bookworm-updates\nComponents: main\n")
    assert control.debian_mirror(tmp_path) == "http://mirror.invalid/debian"


def test_mirror_from_one_line_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("HSX_LAB_MIRROR", raising=False)
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text("deb [arch=amd64] http://mirror.invalid/deb bookworm main\n")
    assert control.debian_mirror(tmp_path) == "http://mirror.invalid/deb"


def test_no_mirror_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("HSX_LAB_MIRROR", raising=False)
    (tmp_path / "sources.list.d").mkdir()
    with pytest.raises(control.LabError, match="no Debian bookworm mirror"):
        control.debian_mirror(tmp_path)


def test_inventory_lists_no_hosts_when_none_run(tmp_path, monkeypatch):
    monkeypatch.setattr(lab, "STATE", tmp_path)
    monkeypatch.setattr(lab, "_netns_names", lambda: [])
    monkeypatch.setattr(lab, "_safe_cgroup_roots", lambda: [])
    data = lab.inventory_data()
    assert data["lab"]["hosts"] == []
    assert data["lab"]["vars"]["ansible_user"] == "root"


def test_host_names_and_addresses_are_prefixed_and_distinct():
    hosts = [lab.Host.make(i, "rw", "512M") for i in range(1, 9)]
    # HSX_LAB_ID (a parallel lab, e.g. make test's molecule lane) goes into every name.
    assert lab.PREFIX == f"hsxlab{os.environ.get('HSX_LAB_ID', '')}"
    assert [h.name for h in hosts] == [f"{lab.PREFIX}-{i}" for i in range(1, 9)]
    assert len({h.address for h in hosts}) == 8
    assert all(len(h.veth) <= 15 for h in hosts)  # kernel limit on interface names


def _venv(root, version="3.11.7"):
    """A venv as `python -m venv` lays it out (made by a Python the hosts do not have)."""
    (root / "bin").mkdir(parents=True)
    (root / "pyvenv.cfg").write_text(
        f"home = /root/.pyenv/versions/{version}/bin\ninclude-system-site-packages = false\n"
        f"version = {version}\nexecutable = /root/.pyenv/versions/{version}/bin/python3.11\n"
        f"command = /root/.pyenv/versions/{version}/bin/python3.11 -m venv {root}\n")
    (root / "bin" / "python3.11").symlink_to(f"/root/.pyenv/versions/{version}/bin/python3.11")
    (root / "bin" / "python").symlink_to("python3.11")
    (root / "bin" / "python3").symlink_to("python3.11")
    return root


def test_lab_venv_runs_with_the_hosts_own_python(tmp_path):
    """--venv: the host's view of the venv names the rootfs's /usr/bin/python3.11 (pyvenv.cfg and
    bin/ links), everything else of pyvenv.cfg kept."""
    rootfs = tmp_path / "rootfs"
    (rootfs / "usr/bin").mkdir(parents=True)
    (rootfs / "usr/bin/python3.11").touch()
    view = _venv(tmp_path / "venv")
    python = lab.venv_python(view, rootfs)
    assert python == "/usr/bin/python3.11"
    lab.repoint_venv(view, python)
    cfg = (view / "pyvenv.cfg").read_text().splitlines()
    assert cfg[0] == "home = /usr/bin" and cfg[-1] == "executable = /usr/bin/python3.11"
    assert "include-system-site-packages = false" in cfg and "version = 3.11.7" in cfg
    assert not [line for line in cfg if "pyenv" in line]
    assert {n: os.readlink(view / "bin" / n) for n in ("python", "python3", "python3.11")} == dict.fromkeys(
        ("python", "python3", "python3.11"), "/usr/bin/python3.11")


def test_lab_venv_of_a_python_the_hosts_lack_is_refused(tmp_path):
    rootfs = tmp_path / "rootfs"
    (rootfs / "usr/bin").mkdir(parents=True)
    (rootfs / "usr/bin/python3.11").touch()
    with pytest.raises(control.LabError, match=r"made by Python 3\.12 .*does not have \(/usr/bin/python3\.12\)"):
        lab.venv_python(_venv(tmp_path / "venv", "3.12.1"), rootfs)
    with pytest.raises(control.LabError, match="not a venv"):
        lab.venv_python(tmp_path / "nothing", rootfs)
