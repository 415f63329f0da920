"""Integration tests run whole playbooks against real lab hosts (root + systemd-nspawn)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
