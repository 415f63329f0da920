"""`hsx takeover HOST`: run playbooks/takeover.yml (a dead host's unfinished buckets to the live hosts)."""

from __future__ import annotations

import argparse
import json

from extraction.fleet.playbook import add_playbook_arguments, run_playbook


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "takeover",
        help="move a dead host's unfinished buckets to the live hosts (takeover.yml); --check shows the plan",
        description="Runs playbooks/takeover.yml with hsx_takeover_host=HOST: finished buckets are read from "
        "each host's own output (an unreachable host finished nothing), the rest of HOST's buckets move to the "
        "hosts that answered (recorded in the fleet's assignment file) and their jobs resume with them. Exit 0: "
        "done (HOST itself may be unreachable); 1: some other host failed; 2: usage.",
    )
    p.add_argument("host", metavar="HOST", help="the inventory name of the host to take over")
    add_playbook_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    args.extra_vars = [*(args.extra_vars or []), json.dumps({"hsx_takeover_host": args.host})]
    return run_playbook(args, "takeover.yml", "takeover")
