"""The `hsx` entry point: discovery of subcommands and the exit-code contract."""

from __future__ import annotations

import subprocess
import sys

import pytest

from extraction import __version__
from extraction.cli import build_parser, command_modules, main
from hsx.exitcodes import EXIT_SIGINT, EXIT_USAGE


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


def test_a_command_loads_its_own_module_alone():
    """`hsx status OUT` imports status's module, not every command's (a poll's CPU): each command's
    name, - as _, is its module's, or the command would fall back to loading them all."""
    every = command_modules()
    names = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert len(names) == len(every)
    for name in names:
        (module,) = command_modules([name, "--help"])
        alone = next(a for a in build_parser([name])._actions if a.dest == "command").choices
        assert list(alone) == [name], (name, module)
    assert command_modules([]) == command_modules(["no-such-command"]) == command_modules(["--help"]) == every
    assert command_modules(["--version"]) == []
    code = ("import contextlib, sys\nfrom extraction.cli import main\nwith contextlib.redirect_stdout(None):\n"
            "    with contextlib.suppress(SystemExit):\n        main(['status', '--help'])\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('extraction.commands.'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == ["extraction.commands.status"], loaded


def _subparsers() -> dict:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return {"hsx": parser, **sub.choices}


def test_abbreviated_flags_are_refused(capsys):
    """`--batch 4` once became --batch-size silently: every parser takes whole flags only."""
    for name, parser in _subparsers().items():
        assert parser.allow_abbrev is False, f"{name}: abbreviations allowed"
    with pytest.raises(SystemExit) as exc:
        main(["extract", "--batch", "4", "--model", "m", "--dataset", "d", "--output", "o"])
    assert exc.value.code == EXIT_USAGE
    assert "unrecognized arguments: --batch" in capsys.readouterr().err


def test_help_shows_defaults():
    """Every option with a default says it in --help (extract's defaults come from ExtractConfig)."""
    helps = {name: p.format_help() for name, p in _subparsers().items()}
    assert "(default: quick)" in helps["verify"] and "(default: 600.0)" in helps["verify"]
    assert "(default: 8)" in helps["extract"]  # --batch-size
    assert "(default: None)" not in "".join(helps.values())


def test_broken_pipe_ends_quietly(tmp_path):
    """`hsx status OUT | head`: the reader going away is no traceback, for every subcommand."""
    from hsx.status import StatusReporter

    StatusReporter(str(tmp_path), total=3, skipped_existing=1, reserve_bytes=0).write()
    code = (
        "import os, sys\n"
        "from extraction import cli\n"
        "r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "status", str(tmp_path), "--json"], capture_output=True, text=True
    )
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode == 141  # 128 + SIGPIPE: what `set -o pipefail` sees from any command


def test_ctrl_c_outside_a_run_is_one_line_not_a_traceback(monkeypatch, capsys):
    """Ctrl-C while a command reads (hsx verify of a big output, a resume's check of its shards
    before the run's own handler is in place) ends with one line and 130."""
    from extraction.commands import status as status_command

    def interrupted(_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(status_command, "run", interrupted)
    assert main(["status", "somewhere"]) == EXIT_SIGINT
    assert capsys.readouterr().err == "hsx status: interrupted (Ctrl-C)\n"
