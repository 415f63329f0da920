"""library/python_info.py: another interpreter's version and the modules it can import (the deploy's
check that the host Python can create a venv, roles/extraction_deploy/tasks/preflight.yml)."""

from __future__ import annotations

import json
import sys

import pytest
from ansible.module_utils.testing import patch_module_args
from ansible_modules import load_module

mod = load_module("python_info")


def run_module(capsys, **args) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        mod.main()
    return json.loads(capsys.readouterr().out)


def test_an_interpreter_that_has_the_modules(capsys) -> None:
    r = run_module(capsys, python=sys.executable, modules=["venv", "ensurepip"], _ansible_check_mode=True)
    assert r["usable"] and r["missing"] == {} and r["error"] is None and not r["changed"]
    assert r["version"] == ".".join(map(str, sys.version_info[:3]))


def test_a_missing_module_or_interpreter_says_why(capsys, tmp_path) -> None:
    r = run_module(capsys, python=sys.executable, modules=["venv", "hsx_no_such_module"])
    assert not r.get("failed") and not r["usable"]
    assert r["missing"] == {"hsx_no_such_module": "ModuleNotFoundError: No module named 'hsx_no_such_module'"}
    r = run_module(capsys, python=str(tmp_path / "python3"), modules=["venv"])
    assert not r.get("failed") and not r["usable"] and r["python"] is None
    assert r["error"] == f"cannot run {tmp_path}/python3: No such file or directory"
    # An interpreter that answers no JSON (a wrapper that prints and exits): named, not a traceback.
    liar = tmp_path / "liar"
    liar.write_text("#!/bin/sh\necho hello\n")
    liar.chmod(0o755)
    r = run_module(capsys, python=str(liar), modules=["venv"])
    assert not r["usable"] and r["error"] == f"{liar} printed no JSON: 'hello'"
