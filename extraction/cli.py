"""The `hsx` command line: discovers subcommands in `extraction.commands`."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from extraction import __version__, commands
from hsx.exitcodes import EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hsx", description="Crash-safe hidden-state extraction and its recovery tools."
    )
    parser.add_argument("--version", action="version", version=f"hsx {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
