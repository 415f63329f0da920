"""`hsx fleet-status`: extraction progress on every host (one ad-hoc run), fleet total, problems marked."""

from __future__ import annotations

import argparse
import sys
import time

from extraction.fleet.fleetstatus import as_json, collect, fleet_total, render
from extraction.fleet.playbook import REPORTS
from extraction.fleet.plot import PlotError, plot_history
from hsx.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_USAGE


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fleet-status",
        help="extraction progress on every host of an inventory, with the fleet total",
        description="Runs the extraction_status_info module on every host in one ad-hoc run. Hosts that are "
        "unreachable, have no job or whose job is not making progress are marked. Exit 0: all "
        "fine; 1: some host marked; 2: usage.",
    )
    p.add_argument(
        "-i",
        "--inventory",
        action="append",
        metavar="INVENTORY",
        help="inventory (repeatable; default: ansible.cfg's, the lab)",
    )
    p.add_argument("-l", "--limit", metavar="HOSTS", help="only these hosts (default: all)")
    p.add_argument("-b", "--become", action="store_true", help="read the outputs as root (sudo)")
    p.add_argument("--json", action="store_true", help="print JSON ('hosts' and 'total')")
    p.add_argument("--watch", type=float, metavar="N", help="refresh every N seconds until interrupted")
    p.add_argument("--plot", metavar="FILE.png", help="also draw samples done over time per host")
    p.add_argument(
        "--report-dir", type=str, default=str(REPORTS), help="runner artifacts go under DIR/.runner"
    )
    p.set_defaults(func=run)


def once(args: argparse.Namespace) -> int:
    from pathlib import Path

    hosts, runner = collect(
        args.inventory,
        args.limit,
        args.become,
        with_history=bool(args.plot),
        report_dir=Path(args.report_dir),
    )
    if not hosts:
        tail = runner.stdout.read()[-3000:] if runner.stdout else ""
        print(
            f"hsx fleet-status: no host answered (rc={runner.rc}); check the inventory and --limit:\n{tail}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.json:
        print(as_json(hosts))
    else:
        render(hosts)
    code = EXIT_FAILED if fleet_total(hosts)["marked"] else EXIT_OK
    if args.plot:
        try:
            plot_history(
                {h.host: h.history for h in hosts},
                args.plot,
                "samples done per host",
                {h.host: h.result.get("total") for h in hosts},
            )
        except PlotError as exc:
            print(f"hsx fleet-status: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if not args.json:
            print(f"plot: {args.plot}")
    return code


def run(args: argparse.Namespace) -> int:
    if args.watch is not None and args.watch <= 0:
        print("hsx fleet-status: --watch needs a positive number of seconds", file=sys.stderr)
        return EXIT_USAGE
    if args.watch is None:
        return once(args)
    code = EXIT_OK
    try:
        while True:
            if sys.stdout.isatty():
                print("\x1b[H\x1b[J", end="")
            print(time.strftime("%Y-%m-%d %H:%M:%S"))
            code = once(args)
            if code == EXIT_USAGE:
                return code
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return code
