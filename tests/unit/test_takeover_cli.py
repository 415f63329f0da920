"""Issue #51 item 7: `hsx takeover HOST --disk-lost` asks playbooks/takeover.yml to redo the host's parked
and finished buckets (hsx_takeover_disk_lost); without it nothing says so (parked buckets stay parked)."""

from __future__ import annotations

import argparse
import json

import pytest

from extraction.commands import takeover


@pytest.mark.parametrize(("flag", "expected"), [([], None), (["--disk-lost"], True)], ids=["plain", "disk-lost"])
def test_disk_lost_reaches_the_playbook(monkeypatch, tmp_path, flag, expected) -> None:
    seen = {}

    def run_playbook(args, playbook, kind):
        seen.update(playbook=playbook, extra=json.loads(args.extra_vars[-1]))
        return 0

    monkeypatch.setattr(takeover, "run_playbook", run_playbook)
    monkeypatch.setattr(takeover, "chosen_inventory", lambda given, command: given)
    parser = argparse.ArgumentParser()
    takeover.register(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["takeover", "node-3", "-i", "inv", "--report-dir", str(tmp_path), *flag])
    assert args.func(args) == 0
    assert seen["playbook"] == "takeover.yml" and seen["extra"]["hsx_takeover_host"] == "node-3"
    assert seen["extra"].get("hsx_takeover_disk_lost") is expected
