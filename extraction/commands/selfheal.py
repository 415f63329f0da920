"""`hsx selfheal remedy|status|resume`: the self-healing loop's brakes on the control node.

`remedy` is what the rulebook's wrapper runs for one alert (extraction/selfheal/remedy.py); `status`
shows the breaker, the held hosts and the recent requests; `resume` is the one documented way a person
closes the breaker (and acknowledges the hosts in it) or re-arms one held host.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from extraction.selfheal import ledger as ledger_mod
from extraction.selfheal import policy as pol
from extraction.selfheal import promtext
from extraction.selfheal import remedy as remedy_mod
from hsx.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_USAGE

HOST_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("selfheal", help="self-healing's brakes: run one remedy, show or resume the loop")
    p.set_defaults(func=lambda _args: p.print_usage(sys.stderr) or EXIT_USAGE)  # an ACTION is required
    sub = p.add_subparsers(dest="selfheal_command", metavar="ACTION", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--state-dir", type=Path, default=ledger_mod.default_state_dir(),
                       help="the loop's ledger (the operator's own directory; $HSX_SELFHEAL_STATE_DIR)")
        q.add_argument("--textfile-dir", help="write hsx-selfheal.prom here (node_exporter's textfile directory "
                       "on the control node) for the alerts that ask a person")

    r = sub.add_parser("remedy", help="one automatic remedy: record, settle, verify, brakes, act, record")
    common(r)
    r.add_argument("--host", required=True, help="the alert's hsx_host")
    r.add_argument("--remedy", required=True, choices=sorted(remedy_mod.REMEDY_PLAYBOOKS))
    r.add_argument("--alert", default="?", help="the alert's name (for the record and the breaker's alert)")
    r.add_argument("--project-dir", type=Path,
                   help="a checkout: its ansible.cfg (when it has one) and playbooks; without it, the installed "
                        "collection hsx.recovery's playbooks by FQCN and your own Ansible configuration")
    r.add_argument("--inventory", action="append", required=True, help="the real inventory (repeatable)")
    r.add_argument("--playbook", help="the remedy playbook: a FQCN, or a path relative to --project-dir (default by "
                   f"--remedy: {', '.join(remedy_mod.REMEDY_PLAYBOOKS.values())} in a checkout, "
                   f"{', '.join(remedy_mod.INSTALLED_PLAYBOOKS.values())} without one)")
    r.add_argument("--report-dir", help="where the recovery writes its reports (default: reports/ in --project-dir, "
                   "else reports/ in --state-dir)")
    r.add_argument("--max-failures", type=int, default=pol.Policy.max_failures,
                   help="failed automatic recoveries of a host in a row before a person is asked")
    r.add_argument("--settle", type=float, default=60.0, help="seconds to wait for other nodes' alerts before deciding")
    r.add_argument("--no-verify", action="store_true", help="act on the alert's claim without checking it")
    r.add_argument("--exporter-port", type=int, default=9100)
    r.add_argument("--progress-window", type=int, default=120,
                   help="a recovery's claim does not hold when the job, alive, made progress this many seconds ago "
                        "(keep it below the stall alert's threshold)")
    r.add_argument("--breaker-share", type=float, default=pol.Policy.share,
                   help="the breaker opens when MORE than this share of the extraction nodes ...")
    r.add_argument("--breaker-min-nodes", type=int, default=pol.Policy.min_nodes, help="... and at least this many")
    r.add_argument("--breaker-window", type=float, default=pol.Policy.window_s, help="... asked within this many seconds")
    r.add_argument("--breaker-max-failed", type=int, default=pol.Policy.max_failed,
                   help="or when this many automatic remedies failed fleet-wide within the window")
    r.add_argument("--flap-max", type=int, default=pol.Policy.flap_max,
                   help="a host recovered automatically this many times within --flap-window is left to a person")
    r.add_argument("--flap-window", type=float, default=pol.Policy.flap_window_s)
    r.set_defaults(func=run_remedy)

    s = sub.add_parser("status", help="the breaker, the held hosts and the recent requests")
    common(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=run_status)

    u = sub.add_parser("resume", help="a person closes the breaker (acknowledging its hosts) or re-arms one host")
    common(u)
    u.add_argument("--host", help="re-arm this held host only (the breaker stays as it is)")
    u.set_defaults(func=run_resume)


def run_remedy(args: argparse.Namespace) -> int:
    import re

    if not re.match(HOST_RE, args.host):
        print(f"hsx selfheal: {args.host!r} is not one host name: nothing run", file=sys.stderr)
        return EXIT_USAGE
    try:
        policy = pol.Policy(share=args.breaker_share, min_nodes=args.breaker_min_nodes, window_s=args.breaker_window,
                            max_failed=args.breaker_max_failed, flap_max=args.flap_max,
                            flap_window_s=args.flap_window, max_failures=args.max_failures)
    except ValueError as exc:
        print(f"hsx selfheal: {exc}", file=sys.stderr)
        return EXIT_USAGE
    project_dir = args.project_dir.resolve() if args.project_dir else None
    if project_dir is not None and not project_dir.is_dir():
        print(f"hsx selfheal: --project-dir {project_dir} is not a directory: nothing run", file=sys.stderr)
        return EXIT_USAGE
    defaults = remedy_mod.REMEDY_PLAYBOOKS if project_dir else remedy_mod.INSTALLED_PLAYBOOKS
    report_dir = args.report_dir or str((project_dir or args.state_dir) / "reports")
    req = remedy_mod.Request(
        host=args.host, remedy=args.remedy, alert=args.alert, project_dir=project_dir,
        inventories=args.inventory, playbook=args.playbook or defaults[args.remedy],
        report_dir=report_dir, max_failures=args.max_failures, settle_s=args.settle, state_dir=args.state_dir,
        textfile_dir=args.textfile_dir, verify=not args.no_verify, exporter_port=args.exporter_port,
        progress_window_s=args.progress_window)
    try:
        return remedy_mod.run(req, policy)
    except (ledger_mod.LedgerError, OSError) as exc:
        print(f"hsx selfheal: {exc}: nothing run", file=sys.stderr)
        return EXIT_USAGE


def _ago(t: float, now: float) -> str:
    return f"{now - t:.0f} s ago"


def run_status(args: argparse.Namespace) -> int:
    try:
        state = ledger_mod.Ledger(args.state_dir).read()
    except ledger_mod.LedgerError as exc:
        print(f"hsx selfheal: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(state, indent=1, sort_keys=True))
        return EXIT_FAILED if state["breaker"] or state["held"] else EXIT_OK
    now = time.time()
    b = state["breaker"]
    if b:
        print(f"BREAKER OPEN since {_ago(b['opened_at'], now)} (cause: {b.get('cause', 'unknown')}): {b['why']}")
        print(f"  alerts: {', '.join(b.get('alerts', []))}; resume with: hsx selfheal resume")
    else:
        print("breaker closed" + (f" (resumed {_ago(state['resumed_at'], now)})" if state["resumed_at"] else ""))
    for host in sorted(state["retired"]):
        print(f"TAKEN OVER {host}: its alerts act no more (returned with a rebalance? hsx selfheal resume --host {host})")
    for host, held in sorted(state["held"].items()):
        print(f"HELD {host} since {_ago(held['since'], now)}: {held['why']} (re-arm: hsx selfheal resume --host {host})")
    for o in state["outcomes"][-10:]:
        print(f"  {_ago(o['at'], now):>12}  {o['host']}  {o.get('remedy', '?')}  {o['outcome']}  {o.get('detail', '')}")
    return EXIT_FAILED if b or state["held"] else EXIT_OK


def run_resume(args: argparse.Namespace) -> int:
    now = time.time()
    try:
        with ledger_mod.Ledger(args.state_dir).locked(now) as state:
            if args.host:
                was = state["held"].pop(args.host, None)
                retired = state["retired"].pop(args.host, None)
                state["host_resumed_at"][args.host] = now
                print(f"{args.host}: re-armed" + (f" (was held: {was['why']})" if was else " (was not held)")
                      + (" and no longer counted as taken over" if retired else ""))
            else:
                b = state["breaker"]
                state["breaker"] = None
                state["resumed_at"] = now
                state["acknowledged"] = sorted(b.get("hosts", [])) if b else []
                print(f"breaker closed (was open: {b['why']}; its hosts' remedies may run once each)" if b
                      else "breaker was closed; windows start now")
            promtext.write(args.textfile_dir or state.get("textfile_dir"), state, now)
    except (ledger_mod.LedgerError, OSError) as exc:
        print(f"hsx selfheal: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK
