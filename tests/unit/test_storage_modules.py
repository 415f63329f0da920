"""library/write_probe.py and library/dump_space_info.py (module_utils/hsx/hostfs.py, modelconfig.py):
roles/storage_guard's two measurements, as modules. tests/unit/test_storage_dumps.py runs the role."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from ansible.module_utils.testing import patch_module_args
from ansible_modules import load_module

from hsx import hostfs

probe_mod = load_module("write_probe")
space_mod = load_module("dump_space_info")


def run_module(capsys, mod, **args) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        mod.main()
    return json.loads(capsys.readouterr().out)


def test_write_probe_reads_back_and_leaves_nothing(capsys, tmp_path) -> None:
    r = run_module(capsys, probe_mod, path=str(tmp_path))
    assert r == {**r, "probed": True, "writable": True, "error": None, "changed": False}
    assert list(tmp_path.iterdir()) == []
    check = run_module(capsys, probe_mod, path=str(tmp_path), _ansible_check_mode=True)
    assert not check["probed"] and check["writable"] is None and list(tmp_path.iterdir()) == []
    r = run_module(capsys, probe_mod, path=str(tmp_path), size=0)
    assert r["failed"] and r["msg"] == "size: 0 is not a positive number of bytes"


def test_write_probe_says_what_failed(capsys, tmp_path) -> None:
    missing = tmp_path / "not-mounted"
    r = run_module(capsys, probe_mod, path=str(missing))
    assert not r.get("failed") and r["probed"] and r["writable"] is False
    assert r["error"] == f"cannot write {missing}/.hsx-write-probe.*: No such file or directory"


def test_write_probe_a_read_back_that_differs(monkeypatch, tmp_path) -> None:
    """A disk returning other bytes than written (stand-in: pread patched to flip the data)."""
    monkeypatch.setattr(hostfs.os, "pread", lambda fd, n, off: b"\0" * (n - 1))
    error = hostfs.write_probe(str(tmp_path), 16)
    assert error.startswith(f"read back differs from what was written to {tmp_path}/.hsx-write-probe.")
    assert list(tmp_path.iterdir()) == []


def test_dump_space_measures_where_the_directory_would_be(capsys, tmp_path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 7168,
                                                                  "max_position_embeddings": 262144}}))
    r = run_module(capsys, space_mod, path=str(tmp_path / "run" / "dumps"), model_path=str(model),
                   _ansible_check_mode=True)
    st = os.statvfs(tmp_path)
    assert r["measured"] == str(tmp_path) and r["hidden"] == 7168 and r["max_positions"] == 262144
    assert abs(r["free_bytes"] - st.f_bavail * st.f_frsize) < 64 << 20 and r["mem_available"] > 0
    assert r["mount"] and r["fstype"] and r["model_error"] is None and not r["changed"]
    assert not (tmp_path / "run").exists()


def test_dump_space_a_model_without_config_is_unsized_saying_why(capsys, tmp_path) -> None:
    r = run_module(capsys, space_mod, path=str(tmp_path), model_path=str(tmp_path / "nomodel"))
    assert not r.get("failed") and r["hidden"] == 0 and r["max_positions"] == 0
    assert r["model_error"] == f"{tmp_path}/nomodel/config.json: cannot read the model's config: No such file or directory"
    (tmp_path / "config.json").write_text("[1]")
    r = run_module(capsys, space_mod, path=str(tmp_path), model_path=str(tmp_path))
    assert r["model_error"] == f"{tmp_path}/config.json: not a JSON object"


def test_mount_of_takes_the_longest_mount_and_decodes_spaces(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\ntmpfs /run tmpfs rw 0 0\n/dev/sdb1 /data\\040disk xfs rw 0 0\n"
                      "tmpfs /run/user/0 tmpfs rw 0 0\n")
    assert hostfs.mount_of("/run/hsx-dumps", str(mounts)) == ("/run", "tmpfs")
    assert hostfs.mount_of("/data disk/hsx", str(mounts)) == ("/data disk", "xfs")
    assert hostfs.mount_of("/runx", str(mounts)) == ("/", "ext4")
