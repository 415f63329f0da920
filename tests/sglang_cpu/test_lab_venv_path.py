"""The molecule scenario sglang_server mounts the venv install.py makes: the same default path."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import install  # noqa: E402

SCENARIO = HERE.parent / "molecule" / "sglang_server" / "molecule.yml"


def test_the_scenario_mounts_install_pys_venv():
    args = yaml.safe_load(SCENARIO.read_text())["ansible"]["env"]["HSX_LAB_ARGS"]
    found = re.fullmatch(r"--venv \$\{HSX_SGLANG_CPU_VENV:-(?P<default>[^}]+)\}", args)
    assert found, f"{SCENARIO}: HSX_LAB_ARGS {args!r} is not '--venv ${{HSX_SGLANG_CPU_VENV:-PATH}}'"
    assert found["default"] == str(install.DEFAULT_VENV), (
        f"{SCENARIO} mounts {found['default']}, install.py installs into {install.DEFAULT_VENV}")
