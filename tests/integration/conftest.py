"""Integration tests run whole playbooks against real lab hosts (root + systemd-nspawn)."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from control_node_account import OPERATOR  # noqa: E402
from labctl import host, lab  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if os.geteuid() != 0 or not shutil.which("systemd-nspawn"):
        skip = pytest.mark.skip(reason="the lab needs root and systemd-nspawn (run `make lab-ensure`)")
        for item in items:
            item.add_marker(skip)


@pytest.fixture
def lab_hosts(request):
    """Boot N lab hosts (param or 1) for one test; always torn down."""
    count = getattr(request, "param", 1)
    lab("up", str(count))
    yield [host(i) for i in range(1, count + 1)]
    lab("down", check=False)


@pytest.fixture
def operator():
    """A fresh local account without sudo (control_node_account.OPERATOR), removed with its home afterwards:
    (its passwd entry, its home)."""
    home = Path("/home") / OPERATOR
    subprocess.run(["userdel", "--remove", OPERATOR], capture_output=True)  # a run killed before its teardown
    subprocess.run(["useradd", "--create-home", "--home-dir", str(home), "--shell", "/bin/sh", OPERATOR],
                   check=True, capture_output=True)
    account = pwd.getpwnam(OPERATOR)
    try:
        yield account, home
    finally:
        # Only the test ran anything as the fresh account: what is left (an ssh master) is ours to end.
        left = subprocess.run(["ps", "-o", "pid=", "-u", str(account.pw_uid)], capture_output=True, text=True)
        for pid in left.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGTERM)
        gone = subprocess.run(["userdel", "--remove", OPERATOR], capture_output=True, text=True)
        assert gone.returncode == 0, f"userdel {OPERATOR}: {gone.stderr}"
