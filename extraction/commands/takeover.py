"""`hsx takeover HOST`: run playbooks/takeover.yml (a dead host's unfinished buckets to the live hosts)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from extraction.fleet.playbook import (
    REPORTS,
    OperatorError,
    add_playbook_arguments,
    chosen_inventory,
    run_playbook,
)
from hsx.exitcodes import EXIT_USAGE

PLAN_TASK = "The plan"  # roles/extraction_job/tasks/takeover.yml's task that says what moves


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "takeover",
        help="move a dead host's unfinished buckets to the live hosts (takeover.yml); --check shows the plan",
        description="Runs takeover.yml (this checkout's playbooks/takeover.yml, else the installed collection's "
        "hsx.recovery.takeover) with hsx_takeover_host=HOST: finished buckets are read from "
        "each host's own output (an unreachable host finished nothing), the rest of HOST's buckets move to the "
        "hosts that answered (recorded in the fleet's assignment file) and their jobs resume with them; HOST's job "
        "is stopped where it answers. HOST may be a host of the assignment file no longer in the inventory. Writes "
        "<reports>/<timestamp>-takeover/ (reports/ of a checkout, else $XDG_STATE_HOME/hsx/reports). Exit 0: "
        "done (HOST itself may be unreachable); 1: some other host failed, "
        "or no plan; 2: usage. An unreachable HOST keeps the buckets it last reported finished (recorded on the "
        "control node by fleet-status, a takeover or a rebalance), parked: not redone until its output is read "
        "again, the park window passes (hsx_takeover_park_window, default 86400 s) or --disk-lost.",
    )
    p.add_argument("host", metavar="HOST", help="the inventory name of the host to take over")
    p.add_argument(
        "--disk-lost",
        action="store_true",
        help="HOST's disk is gone: its parked and finished buckets move to the live hosts too and are redone",
    )
    add_playbook_arguments(p)
    p.set_defaults(func=run)


def plan_message(artifact_dir: Path) -> str | None:
    """The plan the playbook printed (its PLAN_TASK's msg), from the run's recorded events."""
    for path in sorted((artifact_dir / "job_events").glob("*.json")):
        try:
            event = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        data = event.get("event_data") or {}
        if event.get("event") == "runner_on_ok" and str(data.get("task", "")).endswith(PLAN_TASK):
            msg = (data.get("res") or {}).get("msg")
            return " ".join(str(msg).split()) if msg else None
    return None


def run(args: argparse.Namespace) -> int:
    try:
        args.inventory = chosen_inventory(args.inventory, "takeover")
    except OperatorError as e:
        print(f"hsx takeover: {e}", file=sys.stderr)
        return EXIT_USAGE
    extra = {"hsx_takeover_host": args.host, **({"hsx_takeover_disk_lost": True} if args.disk_lost else {})}
    args.extra_vars = [*(args.extra_vars or []), json.dumps(extra)]
    code = run_playbook(args, "takeover.yml", "takeover")
    artifacts = (args.report_dir or REPORTS).resolve() / ".runner" / "artifacts"
    runs = sorted(artifacts.glob(f"*-takeover-{os.getpid()}"))  # this process's run (run_playbook's ident)
    plan = plan_message(runs[-1]) if runs else None
    if plan:
        print(f"\nPlan: {plan}")
    return code
