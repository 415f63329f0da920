"""`hsx recover`: run recover.yml through ansible-runner with a per-host live view and its report."""

from __future__ import annotations

import argparse

from extraction.fleet.playbook import add_playbook_arguments, run_playbook


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "recover",
        help="recover crashed extraction nodes (recover.yml) with a live per-host view and a report",
        description="Runs playbooks/recover.yml through ansible-runner. Exit 0: every host ok; 1: some host "
        "failed or was unreachable; 2: usage.",
    )
    add_playbook_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_playbook(args, "recover.yml", "recover")
