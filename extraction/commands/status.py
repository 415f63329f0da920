"""`hsx status OUTPUT [OUTPUT...]`: a run's status.json for people (or --json), summed over nodes."""

from __future__ import annotations

import argparse
import json
import os
import sys

from hsx.exitcodes import EXIT_OK, EXIT_USAGE
from hsx.status import describe, pid_alive, process_gone, read_status, summarize


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("status", help="show the progress of one or more extraction outputs")
    p.add_argument("outputs", nargs="+", metavar="OUTPUT", help="output directory of `hsx extract`")
    p.add_argument("--json", action="store_true", help="print JSON (one object; 'outputs' and 'total')")
    p.add_argument("--plot", metavar="FILE.png", help="also draw samples done over time (needs matplotlib)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    statuses, code = [], EXIT_OK
    for out in args.outputs:
        try:
            s = read_status(out)
        except FileNotFoundError:
            print(
                f"hsx status: {out}: no status.json (not an extraction output, or not started)",
                file=sys.stderr,
            )
            code = EXIT_USAGE
            continue
        except (OSError, ValueError) as e:
            print(f"hsx status: {out}: unreadable status.json: {e}", file=sys.stderr)
            code = EXIT_USAGE
            continue
        s.setdefault("output", os.path.abspath(out))
        s["pid_alive"] = pid_alive(s.get("pid"), s.get("host"))
        if process_gone(s):
            s["state_note"] = "the process is gone: crashed or killed; run hsx extract again to resume"
        statuses.append(s)
    if args.plot and statuses:
        code = max(code, _plot(statuses, args.plot))
    if args.json:
        payload = {"outputs": statuses, "total": summarize(statuses) if statuses else None}
        print(json.dumps(payload, indent=2, sort_keys=True))
        return code
    for s in statuses:
        print(describe(s))
        if s.get("state_note"):
            print(f"  NOTE: {s['state_note']}")
    if len(statuses) > 1:
        t = summarize(statuses)
        pct = f" ({100 * t['done'] / t['total']:.1f}%)" if t["total"] else ""
        print(
            f"TOTAL over {t['outputs']} outputs: done {t['done']}/{t['total']}{pct}, errors {t['errors']}, "
            f"{t['samples_per_s']} samples/s, ETA {t['eta_s'] if t['eta_s'] is not None else '?'} s"
        )
    return code


def _plot(statuses: list[dict], path: str) -> int:
    """Draw each output's history; 2 (usage/I-O) when it cannot be drawn."""
    from extraction.fleet.plot import PlotError, plot_history

    series = {s["output"]: s.get("history") or [] for s in statuses}
    totals = {s["output"]: s.get("total") for s in statuses}
    try:
        plot_history(series, path, "samples done", totals)
    except PlotError as exc:
        print(f"hsx status: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"plot: {path}", file=sys.stderr)
    return EXIT_OK
