"""inventory/example: what a first-time user copies. Every setting it names is one roles/hsx
declares, and the hf backend's device (default cpu: a GPU node running hf would run on its CPU)
is named there, beside hsx_backend."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "inventory/example/group_vars/all.yml"


def _declared() -> set[str]:
    specs = yaml.safe_load((ROOT / "roles/hsx/meta/argument_specs.yml").read_text())
    return {name for entry in specs["argument_specs"].values() for name in entry.get("options", {})}


def test_every_hsx_setting_named_is_declared_and_hsx_device_is_named() -> None:
    text = EXAMPLE.read_text()
    named = set(re.findall(r"^#?\s*(hsx_\w+):", text, re.M))
    assert named <= _declared(), named - _declared()
    assert "hsx_device" in named, "the hf backend's device (role default cpu) is not in inventory/example"
