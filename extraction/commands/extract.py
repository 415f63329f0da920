"""`hsx extract`: resumable, crash-safe hidden-state extraction (exit 0/1/2/75/130/143)."""

from __future__ import annotations

import argparse
import os

from extraction.inputs import config
from hsx.exitcodes import EXIT_USAGE

NO_OTHERS = 0o027  # umask bits always set: no group write, nothing for others


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "extract",
        help="extract hidden states into an output directory (resumable)",
        description=(
            "Extract EAGLE-3 hidden states, one shard per sample, resuming where a previous run "
            "stopped. Exit codes: 0 done, 1 failed, 2 usage/I-O error, 75 paused (disk low), "
            "130/143 interrupted."
        ),
    )
    config.add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from extraction.inputs import preflight

    try:
        cfg = config.build_config(args)
        preflight.check_inputs(cfg)  # before torch is imported: a mistake is reported at once
    except (config.ConfigError, preflight.InputError) as e:
        print(f"hsx extract: {e}", file=sys.stderr)
        return EXIT_USAGE
    from extraction.runner import Runner

    # The output reveals the dataset (input_ids): nothing in it readable by others, whatever umask
    # the caller has (a manual run as root: 022). The unit sets UMask=0027 itself; this only adds.
    # Put back afterwards: main() also runs in-process (tests, tools).
    old = os.umask(NO_OTHERS)
    os.umask(old | NO_OTHERS)
    try:
        return Runner(cfg).run()
    finally:
        os.umask(old)
