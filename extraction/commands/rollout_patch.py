"""`hsx rollout-patch`: run rollout_patch.yml (the SGLang patch, fleet-wide) with a per-host live view."""

from __future__ import annotations

import argparse

from extraction.fleet.playbook import add_playbook_arguments, run_playbook


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "rollout-patch",
        help="roll the SGLang patch out over the fleet (rollout_patch.yml) with a live view",
        description="Runs rollout_patch.yml (this checkout's playbooks/rollout_patch.yml, else the installed collection's "
        "hsx.recovery.rollout_patch) through ansible-runner. Exit 0: every host ok; 1: some "
        "host failed or was unreachable; 2: usage (or the playbook is missing).",
    )
    add_playbook_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_playbook(args, "rollout_patch.yml", "rollout-patch")
