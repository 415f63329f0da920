"""`hsx wheelhouse DIR`: build the wheelhouse hosts install from (control node)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from extraction.deploy.wheelhouse import WheelhouseError, build
from hsx.exitcodes import EXIT_FAILED, EXIT_OK


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("wheelhouse", help="build the wheelhouse that hosts install the extraction from")
    p.add_argument("dest", type=Path, help="directory of wheels (created; refreshed only when inputs changed)")
    p.add_argument("--source", type=Path, help="source checkout (default: the one this hsx runs from)")
    p.add_argument("--constraints", type=Path, help="pins (default: SOURCE/constraints.txt)")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        manifest = build(args.dest, args.source, args.constraints)
    except WheelhouseError as exc:
        print(f"hsx wheelhouse: {exc}")
        return EXIT_FAILED
    if args.json:
        print(json.dumps(manifest, sort_keys=True))
    else:
        state = "rebuilt" if manifest["changed"] else "unchanged"
        print(f"{args.dest}: {state}; {manifest['package_wheel']} + {len(manifest['wheels']) - 1} dependencies, "
              f"digest {manifest['digest'][:12]}")
    return EXIT_OK
