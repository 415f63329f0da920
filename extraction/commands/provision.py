"""`hsx provision`: run provision.yml through ansible-runner with a per-host live view."""

from __future__ import annotations

import argparse

from extraction.fleet.playbook import add_playbook_arguments, run_playbook


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "provision",
        help="provision fresh extraction nodes (provision.yml) with a live per-host view",
        description="Runs provision.yml (this checkout's playbooks/provision.yml, else the installed collection's "
        "hsx.recovery.provision) through ansible-runner. Exit 0: every host ok; 1: some host "
        "failed or was unreachable; 2: usage (or the playbook is missing).",
    )
    add_playbook_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_playbook(args, "provision.yml", "provision")
