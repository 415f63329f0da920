"""`hsx fleet-status`: extraction progress on every host (one ad-hoc run), fleet total, problems marked."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

from extraction.fleet.fleetbuckets import fleet_view, mark_taken_over, prometheus_text, render_view
from extraction.fleet.fleetstatus import HostStatus, as_json, collect, fleet_total, render
from extraction.fleet.playbook import REPORTS, OperatorError, chosen_inventory, playbook_source
from extraction.fleet.plot import PlotError, plot_history
from hsx.assignfile import AssignmentFileError, default_path, read_assignment, readable_path
from hsx.buckets import AssignError, parse_assign
from hsx.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from hsx.finishedrecord import record_path, update_record
from hsx.fsutil import atomic_write_bytes


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "fleet-status",
        help="extraction progress on every host of an inventory, with the fleet total",
        description="Runs the extraction_status_info module on every host in one ad-hoc run. Hosts that are "
        "unreachable, have no job or whose job is not making progress are marked. With buckets (a fleet split, "
        "issue 39) it also shows the whole dataset: buckets done / running / on unreachable hosts / unassigned per "
        "host and overall, samples done once, done twice (after a takeover) and missing. Exit 0: all fine and "
        "nothing missing; 1: some sample missing, or a host marked (a host taken over is not counted); 2: usage.",
    )
    p.add_argument(
        "-i",
        "--inventory",
        action="append",
        metavar="INVENTORY",
        help="inventory (repeatable; default: ANSIBLE_INVENTORY; one of them is needed)",
    )
    p.add_argument("-l", "--limit", metavar="HOSTS",
                   help="only these hosts (default: all); the dataset's completeness is then not given")
    p.add_argument("-b", "--become", action="store_true", help="read the outputs as root (sudo)")
    p.add_argument("--json", action="store_true", help="print JSON ('hosts', 'total' and 'dataset')")
    p.add_argument(
        "--assignment",
        metavar="FILE",
        help="the fleet's assignment file (default: .fleet/assignment.json beside the first inventory, if there)",
    )
    p.add_argument(
        "--prom",
        metavar="FILE.prom",
        help="also write the dataset view as Prometheus text (node_exporter's textfile collector), atomically",
    )
    p.add_argument("--watch", type=float, metavar="N", help="refresh every N seconds until interrupted")
    p.add_argument("--plot", metavar="FILE.png", help="also draw samples done over time per host")
    p.add_argument(
        "--report-dir", type=str, default=str(REPORTS),
        help="runner artifacts go under DIR/.runner (default: %(default)s; reports/ in the checkout hsx runs from, "
        "installed $XDG_STATE_HOME/hsx/reports, else ~/.local/state/hsx/reports)"
    )
    p.set_defaults(func=run)


def assignment_path(path: str | None, inventory: list[str] | None) -> str | None:
    """The assignment file given, else its default place beside the first inventory
    (.fleet/assignment.json, or the old fleet/assignment.json until a play moves it); None without either."""
    if path:
        return os.path.abspath(path)
    first = Path(inventory[0]) if inventory else None
    if first is None or not first.exists():
        return None
    base = first if first.is_dir() else first.parent
    return readable_path(default_path(str(base.resolve())))


def load_assignment(path: str | None, inventory: list[str] | None) -> dict[str, Any] | None:
    """The assignment at assignment_path(path, inventory), when it exists (--assignment: it must)."""
    where = assignment_path(path, inventory)
    found = read_assignment(where) if where else None
    if found is None and path:
        raise AssignmentFileError(f"--assignment {path}: no such file")
    return found


def record_finished(where: str, hosts: list[HostStatus], assignment: dict[str, Any]) -> None:
    """Record on the control node, beside the assignment, what each host that answered reports finished
    (hsx.finishedrecord: a later takeover parks those buckets when that host no longer answers). A
    host whose index or bucket totals could not be read reports nothing and is left as recorded."""
    n = assignment["buckets"]
    reports = {}
    for h in hosts:
        r = h.result
        if (h.unreachable or h.error or not r or r.get("buckets_error") or r.get("bucket_count") != n
                or not isinstance(r.get("bucket_totals"), list)):
            continue
        spec = str(r.get("finished_buckets") or "")
        reports[h.host] = set(parse_assign(spec, n)) if spec.strip() else set()
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    update_record(record_path(where), n, reports, "fleet-status", now)


LIMITED_VIEW: dict[str, Any] = {
    "known": False,
    "reason": "--limit asks some hosts only; the dataset's completeness needs them all (run without --limit)",
}


def exit_code(hosts: list[HostStatus], view: dict[str, Any]) -> int:
    """1 while a sample is missing, the hosts' copies of the dataset disagree, or a host is marked
    with an alarm (one taken over is not, unless its job runs on: `mark_taken_over` first), else 0."""
    marked = fleet_total(hosts)["marked"]
    missing = view.get("known") and (view["samples"]["missing"] > 0 or view.get("inconsistent"))
    return EXIT_FAILED if marked or missing else EXIT_OK


def write_prom(path: str, view: dict[str, Any], hosts: list[HostStatus] | None = None) -> None:
    """The view as a Prometheus textfile, replaced atomically; the temp is made 0644 (node_exporter
    reads it as another user), so the file never has another mode under its name."""
    atomic_write_bytes(os.path.abspath(path), prometheus_text(view, hosts).encode("utf-8"), mode=0o644)


def once(args: argparse.Namespace) -> int:
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
    try:
        assignment = load_assignment(args.assignment, args.inventory)
    except AssignmentFileError as exc:
        print(f"hsx fleet-status: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if assignment is not None:
            record_finished(str(assignment_path(args.assignment, args.inventory)), hosts, assignment)
        record_error = None
    except (AssignmentFileError, AssignError) as exc:  # FinishedRecordError is one; a bad range from a host
        record_error = str(exc)
    mark_taken_over(hosts, assignment)
    # Under --limit the hosts not asked would read as unreachable and their samples as missing:
    # the dataset's view needs every host.
    view = LIMITED_VIEW if args.limit else fleet_view(hosts, assignment)
    if args.json:
        print(as_json(hosts, view))
    else:
        render(hosts)
        print("\n".join(render_view(view)))
    if args.prom:
        write_prom(args.prom, view, hosts)
    code = exit_code(hosts, view)
    if record_error:
        print(f"hsx fleet-status: cannot record what the hosts finished: {record_error}", file=sys.stderr)
        code = EXIT_USAGE
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
    try:
        args.inventory = chosen_inventory(args.inventory, "fleet-status")
    except OperatorError as e:
        print(f"hsx fleet-status: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        where = playbook_source()  # the checkout, else the installed hsx.recovery: neither, say where it looked
    except OperatorError as e:
        print(f"hsx fleet-status: {e}", file=sys.stderr)
        return EXIT_USAGE
    if where.checkout is None:
        print(f"hsx fleet-status: module {where.module('extraction_status_info')}: {where.describe()}", file=sys.stderr)
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
