"""Dumps in RAM by default (issue #29 item 2): one source of truth for the default dump directory
(hsx.layout.DEFAULT_DUMP_DIR): the CLI's default and the roles' hsx_dump_dir."""

from __future__ import annotations

from pathlib import Path

import yaml

from extraction.inputs.config import build_config
from hsx.layout import DEFAULT_DUMP_DIR

ROOT = Path(__file__).resolve().parents[2]
SGLANG = {"model": "m", "dataset": "d", "output": "o", "backend": "sglang", "server_url": "http://127.0.0.1:1"}


def test_default_dump_dir_is_ram_everywhere(monkeypatch):
    monkeypatch.delenv("HSX_DUMP_DIR", raising=False)
    assert DEFAULT_DUMP_DIR.startswith("/run/")  # tmpfs, and only root may create names there
    assert build_config(SGLANG).dump_dir == DEFAULT_DUMP_DIR
    monkeypatch.setenv("HSX_DUMP_DIR", "/x/env")
    assert build_config(SGLANG).dump_dir == "/x/env"
    assert build_config({**SGLANG, "dump_dir": "/x/flag"}).dump_dir == "/x/flag"
    assert build_config({**SGLANG, "backend": "hf"}).dump_dir is None
    roles = yaml.safe_load((ROOT / "roles/hsx/defaults/main.yml").read_text())
    assert roles["hsx_dump_dir"] == DEFAULT_DUMP_DIR, "roles/hsx and hsx.layout disagree on the default"
