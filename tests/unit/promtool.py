"""promtool (Debian's `prometheus` package) for the metrics and alert-rule tests.

`make test` installs it with the lab's control packages (tests/lab/lab.py ensure). Run alone, the
tests install it the same way when they can (root and apt); they skip, saying why, only where it
truly cannot be installed.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@functools.cache
def _install() -> str:
    """'' when promtool is there (installing it first where we can); else why not."""
    if shutil.which("promtool"):
        return ""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "promtool is not installed and cannot be here (needs root and apt): apt-get install prometheus"
    spec = importlib.util.spec_from_file_location("hsx_lab_for_promtool", REPO / "tests" / "lab" / "lab.py")
    lab = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = lab  # its dataclasses look their module up there
    spec.loader.exec_module(lab)
    try:
        lab.ensure_control_packages()
    except Exception as e:  # no package source reachable, say
        return f"promtool is not installed and installing Debian's prometheus package failed: {e}"
    return "" if shutil.which("promtool") else "Debian's prometheus package installed no promtool"


def promtool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """`promtool ARGS` (installed first if need be; the test skips where it cannot be)."""
    why = _install()
    if why:
        pytest.skip(why)
    return subprocess.run(["promtool", *args], input=stdin, capture_output=True, timeout=120)
