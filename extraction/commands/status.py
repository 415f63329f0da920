"""`hsx status OUTPUT [OUTPUT...]`: a run's status.json for people (or --json), summed over nodes.

The exit status says what state the runs are in (STATUS_EXIT_CODES, the one table: --help and the
README repeat it); scripts and Ansible read it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from hsx.exitcodes import EXIT_CRASHED, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PAUSED, EXIT_USAGE
from hsx.status import describe, pid_alive, process_gone, read_status, summarize

# (exit status, verdict, when). With several outputs the first row any of them has wins.
STATUS_EXIT_CODES: tuple[tuple[int, str, str], ...] = (
    (EXIT_USAGE, "unreadable", "no status.json, or one that cannot be read"),
    (EXIT_FAILED, "failed", "the run failed: see its message and errors.jsonl"),
    (EXIT_CRASHED, "crashed", "starting/running by status.json, but its process on this host is gone: rerun to resume"),
    (EXIT_PAUSED, "paused", "paused: disk low: free space, then rerun to resume"),
    (EXIT_INTERRUPTED, "interrupted", "stopped by a signal: rerun to resume"),
    (EXIT_OK, "ok", "done, or under way (alive, or on another host: cannot tell)"),
)
_CODE = {verdict: code for code, verdict, _ in STATUS_EXIT_CODES}
_RANK = {code: rank for rank, (code, _, _) in enumerate(STATUS_EXIT_CODES)}


def verdict(status: dict[str, Any]) -> str:
    """The STATUS_EXIT_CODES verdict of one checked status (with `pid_alive` set)."""
    state = status.get("state")
    if process_gone(status):
        return "crashed"
    if state == "failed":
        return "failed"
    if isinstance(state, str) and state.startswith("paused"):
        return "paused"
    return "interrupted" if state == "interrupted" else "ok"


def worst(codes: list[int]) -> int:
    """The exit status of several outputs: the code of the first STATUS_EXIT_CODES row present."""
    return min(codes, key=_RANK.__getitem__, default=EXIT_OK)


def _epilog() -> str:
    rows = "; ".join(f"{code} {verdict}: {when}" for code, verdict, when in STATUS_EXIT_CODES)
    return f"Exit status (several outputs: the first of these that any has): {rows}."


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "status", help="show the progress of one or more extraction outputs", description=_epilog()
    )
    p.add_argument("outputs", nargs="+", metavar="OUTPUT", help="output directory of `hsx extract`")
    p.add_argument("--json", action="store_true", help="print JSON (one object; 'outputs' and 'total')")
    p.add_argument("--plot", metavar="FILE.png", help="also draw samples done over time (needs matplotlib)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    statuses, codes = [], [EXIT_OK]
    for out in args.outputs:
        try:
            s = read_status(out)
        except FileNotFoundError:
            print(
                f"hsx status: {out}: no status.json (not an extraction output, or not started)",
                file=sys.stderr,
            )
            codes.append(EXIT_USAGE)
            continue
        except (OSError, ValueError) as e:
            print(f"hsx status: {out}: unreadable status.json: {e}", file=sys.stderr)
            codes.append(EXIT_USAGE)
            continue
        s.setdefault("output", os.path.abspath(out))
        s["pid_alive"] = pid_alive(s.get("pid"), s.get("host"))
        s["verdict"] = verdict(s)
        s["exit_code"] = _CODE[s["verdict"]]
        codes.append(s["exit_code"])
        if s["verdict"] == "crashed":
            s["state_note"] = (
                f"state crashed: the process is gone (status.json still says {s.get('state')}): "
                "crashed or killed; run hsx extract again to resume"
            )
        statuses.append(s)
    if args.plot and statuses:
        codes.append(_plot(statuses, args.plot))
    code = worst(codes)
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
