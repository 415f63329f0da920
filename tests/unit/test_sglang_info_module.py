"""library/sglang_info.py: an interpreter's SGLang, asked through module_utils/hsx/pyprobe.py.

The interpreter asked is a stand-in: a shell script running this Python with a site directory that
holds a fake `sglang` package (an __init__.py that would fail if imported) and the dist-info a pip
install leaves; a real SGLang venv is 7 GB (tests/sglang_cpu)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from ansible.module_utils.testing import patch_module_args
from ansible_modules import load_module

from hsx.sglang_versions import MIN_VERSION, SUPPORTED_VERSIONS

mod = load_module("sglang_info")


def run_module(capsys, **args) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        mod.main()
    return json.loads(capsys.readouterr().out)


def stand_in_python(tmp_path: Path, version: str | None) -> Path:
    """An interpreter whose sys.path has a `sglang` package (of `version`'s dist-info; None: no package)."""
    site = tmp_path / "site"
    site.mkdir()
    if version is not None:
        (site / "sglang").mkdir()
        (site / "sglang" / "__init__.py").write_text("raise SystemExit('imported: the probe must not import sglang')\n")
        dist = site / f"sglang-{version}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    return python


def test_finds_the_package_and_judges_its_release_without_importing_it(capsys, tmp_path) -> None:
    newest = SUPPORTED_VERSIONS[-1]
    python = stand_in_python(tmp_path, newest + "+cu129")
    r = run_module(capsys, python=str(python))
    assert r["found"] and r["package"] == str(tmp_path / "site" / "sglang")
    assert r["version"] == newest + "+cu129" and r["release"] == newest
    assert r["supported"] and r["support_problem"] is None and r["min_version"] == MIN_VERSION
    assert not r["changed"] and not r["check_mode"] and r["error"] is None
    # Check mode: the same answer, and it says so (a task's check_mode, which ansible_check_mode misses).
    check = run_module(capsys, python=str(python), _ansible_check_mode=True)
    assert check["check_mode"] and check["found"] and check["release"] == newest


def test_an_unsupported_release_says_why(capsys, tmp_path) -> None:
    r = run_module(capsys, python=str(stand_in_python(tmp_path, "0.5.4")))
    assert r["found"] and not r["supported"] and "older than " + MIN_VERSION in r["support_problem"]


def test_no_package_or_no_interpreter_is_an_answer_not_a_failure(capsys, tmp_path) -> None:
    r = run_module(capsys, python=str(stand_in_python(tmp_path, None)))
    assert not r.get("failed") and not r["found"] and r["error"] == "no importable sglang package"
    assert r["version"] is None and r["release"] == "" and not r["supported"]
    r = run_module(capsys, python=str(tmp_path / "nowhere" / "python"))
    assert not r.get("failed") and not r["found"] and r["python"] is None
    assert r["error"] == f"cannot run {tmp_path}/nowhere/python: No such file or directory"


def test_a_pinned_version_is_judged_without_asking(capsys) -> None:
    r = run_module(capsys, version="0.5.14.post9", python="/nonexistent/python")
    assert r["version"] == "0.5.14.post9" and r["release"] == "0.5.14.post9" and not r["found"]
    assert not r["supported"] and "not in the tested list" in r["support_problem"] and r["error"] is None
    r = run_module(capsys)
    assert r["failed"] and "one of the following is required: python, version" in r["msg"]
