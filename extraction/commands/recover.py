"""`hsx recover`: run recover.yml through ansible-runner with a per-host live view and its report."""

from __future__ import annotations

import argparse
import sys

from extraction.fleet.playbook import OperatorError, add_playbook_arguments, chosen_inventory, run_playbook
from hsx.exitcodes import EXIT_USAGE


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "recover",
        help="recover crashed extraction nodes (recover.yml) with a live per-host view and a report",
        description="Runs recover.yml (this checkout's playbooks/recover.yml, else the installed collection's "
        "hsx.recovery.recover) through ansible-runner. Exit 0: every host ok; 1: some host "
        "failed or was unreachable; 2: usage.",
    )
    add_playbook_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        args.inventory = chosen_inventory(args.inventory, "recover")
    except OperatorError as e:
        print(f"hsx recover: {e}", file=sys.stderr)
        return EXIT_USAGE
    return run_playbook(args, "recover.yml", "recover")
