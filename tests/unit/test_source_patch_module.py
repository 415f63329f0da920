"""library/source_patch.py driven through AnsibleModule with patch_module_args, on a real release file."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from ansible.module_utils.testing import patch_module_args
from ansible_modules import load_module

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import sglang_wheels  # noqa: E402

from hsx.sglang_patch import SGLANG_DUMP_PATCH_V1  # noqa: E402
from hsx.sglang_versions import SUPPORTED_VERSIONS, UNSUPPORTED_EXAMPLE  # noqa: E402

source_patch = load_module("source_patch")


def run_module(capsys, **args) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        source_patch.main()
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def target(tmp_path) -> Path:
    path = tmp_path / "deepseek_v2.py"
    shutil.copy(sglang_wheels.require(SUPPORTED_VERSIONS[-1]) / "deepseek_v2.py", path)
    return path


def test_check_apply_reapply_absent(capsys, target):
    original = target.read_bytes()
    r = run_module(
        capsys, path=str(target), patch="sglang_dump_hook", _ansible_check_mode=True, _ansible_diff=True
    )
    assert r["changed"] and r["before"] == "unpatched" and target.read_bytes() == original
    assert r["diff"]["before"] == original.decode() and "hsx_dump_hook" in r["diff"]["after"]
    r = run_module(
        capsys, path=str(target), patch="sglang_dump_hook", sglang_version=SUPPORTED_VERSIONS[-1], backup=True
    )
    assert r["changed"] and r["after"] == "patched" and Path(r["backup_file"]).read_bytes() == original
    assert "diff" not in r  # the whole file twice only when --diff asks (issue #42 item 2)
    patched = target.read_bytes()
    r = run_module(capsys, path=str(target), patch="sglang_dump_hook")
    assert not r["changed"] and r["before"] == "patched" and "diff" not in r
    assert target.read_bytes() == patched
    r = run_module(capsys, path=str(target), patch="sglang_dump_hook", state="absent")
    assert r["changed"] and r["original_verified"] is True and target.read_bytes() == original


def test_older_version_is_upgraded(capsys, target):
    blocks = SGLANG_DUMP_PATCH_V1["blocks"]
    r = run_module(capsys, path=str(target), patch_id="hsx-sglang-dump", version="1", blocks=blocks)
    assert r["changed"] and r["patch_version"] == "1"
    r = run_module(capsys, path=str(target), patch="sglang_dump_hook", _ansible_check_mode=True)
    assert r["changed"] and r["before"] == "outdated" and r["found_version"] == "1"
    r = run_module(capsys, path=str(target), patch="sglang_dump_hook")
    assert r["changed"] and r["before"] == "outdated"
    assert run_module(capsys, path=str(target), patch="sglang_dump_hook")["before"] == "patched"


def test_unsupported_version_and_missing_anchors_fail_before_any_change(capsys, target, tmp_path):
    before = target.read_bytes()
    r = run_module(capsys, path=str(target), patch="sglang_dump_hook", sglang_version="0.5.9")
    assert r["failed"] and "0.5.9 is older than 0.5.10" in r["msg"] and target.read_bytes() == before
    old = tmp_path / "old.py"
    shutil.copy(sglang_wheels.require(UNSUPPORTED_EXAMPLE) / "deepseek_v2.py", old)
    r = run_module(capsys, path=str(old), patch="sglang_dump_hook", force=True)
    assert r["failed"] and "not found" in r["msg"] and not r["changed"]


def test_adhoc_patch_and_argument_errors(capsys, tmp_path):
    f = tmp_path / "app.py"
    f.write_text("def handle(self, request):\n    return request\n")
    block = {"name": "log", "anchor": "def handle(self, request):", "where": "after", "code": ["    x = 1"]}
    r = run_module(capsys, path=str(f), patch_id="trace", blocks=[block])
    assert r["changed"] and "    x = 1\n" in f.read_text()
    bad = dict(block, code=["  x = 1"])  # would break the indentation
    r = run_module(capsys, path=str(f), patch_id="trace", version="2", blocks=[bad])
    assert r["failed"] and "does not parse" in r["msg"]
    r = run_module(capsys, path=str(f), patch="sglang_dump_hook", patch_id="x")
    assert r["failed"] and "mutually exclusive" in r["msg"]


def test_ansible_doc_renders(module_doc):
    doc = module_doc("source_patch")
    assert "sglang_dump_hook" in doc["doc"]["options"]["patch"]["choices"] and "original_verified" in doc["return"]
    assert doc["doc"]["attributes"]["check_mode"]["description"]  # from the doc fragment
