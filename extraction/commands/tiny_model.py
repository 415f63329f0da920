"""`hsx tiny-model DIR`: the deterministic tiny DeepSeek-V3-architecture target (offline)."""

from __future__ import annotations

import argparse

from extraction.testbed.tiny import LAYERS
from hsx.exitcodes import EXIT_OK, EXIT_USAGE


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tiny-model", help="build the tiny DeepSeek-V3-architecture test target (same seed, same bytes)"
    )
    p.add_argument("dir", metavar="DIR", help="directory to write (config, safetensors, tokenizer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=64, help="hidden size (benchmarks scale it up)")
    p.add_argument(
        "--layers",
        type=int,
        default=LAYERS,
        help=f"decoder layers (default {LAYERS}: the default capture layers [2, N//2, N-3] are distinct)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from extraction.testbed.tiny import build_tiny_model

    try:
        out = build_tiny_model(args.dir, seed=args.seed, hidden=args.hidden, layers=args.layers)
    except OSError as e:
        print(f"hsx tiny-model: {args.dir}: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(out)
    return EXIT_OK
