"""Issue #51 item 7: `hsx takeover NODE --check` without `-i` silently used the lab's inventory
(ansible.cfg's default) and answered "No hosts to act on". The operator's commands (hsx takeover,
hsx recover, hsx fleet-status) say which inventory they act on, and never fall back to the lab's:
-i, or ANSIBLE_INVENTORY, or nothing runs; the lab's inventory only when named."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import ansible_runner
import pytest

from extraction.cli import main
from extraction.fleet.playbook import REPO

COMMANDS = [["takeover", "n2", "--check"], ["recover", "--check"], ["fleet-status"]]


@pytest.fixture
def runs(monkeypatch, tmp_path) -> list[dict]:
    """ansible_runner.run, recorded: what each command would have run (nothing runs here)."""
    calls: list[dict] = []

    def fake_run(**kwargs):
        calls.append(kwargs)
        artifacts = Path(kwargs["private_data_dir"]) / "artifacts" / kwargs["ident"]
        artifacts.mkdir(parents=True, exist_ok=True)
        return SimpleNamespace(rc=0, status="successful", stdout=None, config=SimpleNamespace(artifact_dir=artifacts))

    monkeypatch.setattr(ansible_runner, "run", fake_run)
    monkeypatch.delenv("ANSIBLE_INVENTORY", raising=False)
    monkeypatch.chdir(tmp_path)
    return calls


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: a[0])
def test_without_an_inventory_nothing_runs_and_the_lab_is_never_the_default(argv, runs, tmp_path, capsys) -> None:
    assert main([*argv, "--report-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "no inventory given" in err and "-i INVENTORY" in err and "ANSIBLE_INVENTORY" in err, err
    assert "-i inventory/lab" in err, err  # how to name the lab's when it is meant
    assert runs == []


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: a[0])
def test_the_inventory_acted_on_is_said_and_passed(argv, runs, tmp_path, monkeypatch, capsys) -> None:
    mine = tmp_path / "inventory" / "mine"
    mine.mkdir(parents=True)
    main([*argv, "-i", "inventory/mine", "--report-dir", str(tmp_path / "r")])
    assert runs and runs[0]["inventory"] == [str(mine)]
    assert f"inventory: {mine} (-i)" in capsys.readouterr().err
    runs.clear()
    monkeypatch.setenv("ANSIBLE_INVENTORY", f"{mine},{tmp_path / 'more.yml'}")
    main([*argv, "--report-dir", str(tmp_path / "r")])
    assert runs and runs[0]["inventory"] == [str(mine), str(tmp_path / "more.yml")]
    assert f"inventory: {mine}, {tmp_path / 'more.yml'} (ANSIBLE_INVENTORY)" in capsys.readouterr().err
    runs.clear()
    monkeypatch.delenv("ANSIBLE_INVENTORY")
    main([*argv, "-i", str(REPO / "inventory" / "lab"), "--report-dir", str(tmp_path / "r")])  # named: the lab's
    assert runs and runs[0]["inventory"] == [str(REPO / "inventory" / "lab")]
    assert f"inventory: {REPO / 'inventory' / 'lab'} (-i: the lab's)" in capsys.readouterr().err
