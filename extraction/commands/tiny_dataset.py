"""`hsx tiny-dataset FILE -n N`: a deterministic conversation set (ShareGPT and OpenAI shapes)."""

from __future__ import annotations

import argparse

from hsx.exitcodes import EXIT_OK, EXIT_USAGE


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("tiny-dataset", help="write N deterministic test conversations as JSONL")
    p.add_argument("file", metavar="FILE")
    p.add_argument("-n", type=int, required=True, help="number of conversations")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from extraction.testbed.tiny import write_tiny_dataset

    if args.n < 0:
        print("hsx tiny-dataset: -n must be >= 0", file=sys.stderr)
        return EXIT_USAGE
    try:
        write_tiny_dataset(args.file, args.n, seed=args.seed)
    except OSError as e:
        print(f"hsx tiny-dataset: {args.file}: {e}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK
