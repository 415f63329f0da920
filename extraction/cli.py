"""The `hsx` command line: discovers subcommands in `extraction.commands`.

Every parser (the top one and each subcommand's) takes whole flags only (`--batch` is not
`--batch-size`) and shows each option's default in --help (HelpFormatter). A reader that goes
away (`hsx status OUT | head`) ends any subcommand quietly, with 141 as a SIGPIPE would; Ctrl-C
outside a run's own handler with one line and 130: no traceback for ordinary use.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import signal
import sys
from typing import Any

from extraction import __version__, commands
from hsx.exitcodes import EXIT_SIGINT, EXIT_USAGE

EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # what a shell's pipefail sees from a command killed by SIGPIPE


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to an option's help unless the help already has a "(default ...)" or
    there is none to show (None, False, []: a flag that is off, nothing given, or a value
    derived at run time)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        nothing = d is None or d is False or d == [] or d == argparse.SUPPRESS  # 0 is a default to show
        if "(default" in text or nothing or not action.option_strings:
            return text
        return super()._get_help_string(action) or text


class Parser(argparse.ArgumentParser):
    """An ArgumentParser without abbreviations and with defaults in --help (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; with `argv` naming one, of that one alone (command_modules)."""
    parser = Parser(prog="hsx", description="Crash-safe hidden-state extraction and its recovery tools.")
    parser.add_argument("--version", action="version", version=f"hsx {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in command_modules(argv):
        importlib.import_module(f"{commands.__name__}.{name}").register(subparsers)
    return parser


def command_modules(argv: list[str] | None = None) -> list[str]:
    """The modules of extraction.commands to load: all of them, or only the one of the subcommand `argv`
    names (its name with - as _). `hsx status OUT` then imports what status needs alone: ~0.07 CPU-s
    instead of ~0.2 for every command's imports, paid by each poll of a script, a test or Ansible.
    `hsx --version` (each recovery's deploy asks it) loads none. Anything else (no command, an unknown one,
    --help at the top) loads them all."""
    names = sorted(info.name for info in pkgutil.iter_modules(commands.__path__))
    args = argv or []
    first = next((a for a in args if not a.startswith("-")), None)
    if first is None and "--version" in args and "--help" not in args and "-h" not in args:
        return []
    wanted = first.replace("-", "_") if first else None
    return [wanted] if wanted in names else names


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, not at exit: a closed pipe is seen while it can be handled
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:  # outside `hsx extract`'s run, whose own handler stops it cleanly
        print(f"hsx {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_SIGINT
    return code


def _silence_stdout() -> None:
    """Point stdout at /dev/null: the interpreter's flush at exit must not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real stdout (tests capture it): nothing to flush
        pass


if __name__ == "__main__":
    sys.exit(main())
