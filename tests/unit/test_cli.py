"""The `hsx` entry point: discovery of subcommands and the exit-code contract."""

from __future__ import annotations

import subprocess
import sys

import pytest

from extraction import __version__
from extraction.cli import build_parser, main
from hsx.exitcodes import EXIT_USAGE


def test_version_is_printed(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"hsx {__version__}"


def test_no_command_is_a_usage_error(capsys):
    assert main([]) == EXIT_USAGE
    assert "COMMAND" in capsys.readouterr().err


def test_unknown_command_exits_2():
    proc = subprocess.run([sys.executable, "-m", "extraction.cli", "no-such-command"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr


def test_every_discovered_command_has_a_handler():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, subparser in sub.choices.items():
        assert subparser.get_default("func") is not None, f"hsx {name} registers no func"
