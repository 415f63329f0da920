"""`hsx report DIR`: turn a recovery's dumped facts into per-host JSON and summary.md."""

from __future__ import annotations

import argparse
import sys

from extraction.fleet.report import build
from hsx.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_USAGE


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("report", help="build a recovery report (per-host JSON + summary.md) from dumped facts")
    p.add_argument("report_dir", help="a reports/<timestamp> directory written by recover.yml")
    p.add_argument("--title", default="Recovery report")
    p.add_argument("--quiet", action="store_true", help="do not print summary.md")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        reports, summary = build(args.report_dir, args.title)
    except (OSError, ValueError) as exc:
        print(f"hsx report: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not args.quiet:
        print(summary.read_text(), end="")
    return EXIT_OK if all(r["ok"] for r in reports) else EXIT_FAILED
