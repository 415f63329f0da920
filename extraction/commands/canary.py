"""`hsx canary`: before a job resumes, prove this node still computes what its shards hold.

Re-extracts a few samples the output already has (extraction/canary/) through the job's own
config and backend - each in its original batch, rebuilt from OUTPUT/batches.jsonl, or alone where
none is recorded - and compares them with their shards. Exit 0 passed (or skipped: nothing to
compare yet), 5 mismatch (this node computes differently: do not resume it), 1 a shard or the
backend failed, 2 a usage or input error. The verdict goes to stderr (one line) and, with --json, to
stdout as one JSON object; the record to OUTPUT/canary.json (not for skipped; --no-record: none).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from extraction.canary.settings import DEFAULT_BATCH_TOLERANCE, DEFAULT_SAMPLES, describe_defaults
from extraction.inputs import config
from hsx.exitcodes import EXIT_USAGE

NO_OTHERS = 0o027  # as `hsx extract`: the record names the output's samples


def _tolerance(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _samples(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r} (to turn the canary off, do not run it)")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "canary",
        help="re-extract a few finished samples and compare them with their shards (before a resume)",
        description=(
            "Re-extract K samples the output already holds through the job's config and backend, each in "
            "its original batch (rebuilt from OUTPUT/batches.jsonl: the same rows, padding and shape; the "
            "K whole batches are forwarded) or, where no batch is recorded (older shards, the sglang "
            "backend), alone; and compare the states with the shards: input_ids and loss_mask equal, each "
            "state's relative error (max |a-b| / max |a|) within --batch-tolerance (default 0: bit-equal) "
            "for a rebuilt batch, within --tolerance (default: by the run's dtype, docs/benchmarks.md "
            "'Canary') for a sample alone. Read-only on the output but for OUTPUT/canary.json. Exit codes: "
            "0 passed or skipped, 5 mismatch, 1 a shard or the backend failed, 2 usage or input error."
        ),
    )
    p.add_argument("--config", required=True, help="the job's YAML config (what `hsx extract --config` reads)")
    p.add_argument("--samples", type=_samples, default=DEFAULT_SAMPLES, help="samples to re-extract")
    p.add_argument(
        "--tolerance",
        type=_tolerance,
        default=None,
        help=f"largest relative error allowed per state of a sample re-run alone (no batch recorded; "
        f"0: bit-equal); default by the run's dtype: {describe_defaults()}",
    )
    p.add_argument(
        "--batch-tolerance",
        type=_tolerance,
        default=DEFAULT_BATCH_TOLERANCE,
        help="largest relative error allowed per state of a sample re-run in its original batch "
        f"(default {DEFAULT_BATCH_TOLERANCE:g}: bit-equal; raise it only for kernels that are not "
        "deterministic run to run)",
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    p.add_argument("--no-record", action="store_true", help="write nothing, not even OUTPUT/canary.json")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from extraction.inputs import preflight

    try:
        cfg = config.build_config({"config": args.config})
        preflight.check_inputs(cfg)  # before torch is imported: a mistake is reported at once
    except (config.ConfigError, preflight.InputError) as e:
        print(f"hsx canary: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps({"state": "error", "message": str(e), "exit_code": EXIT_USAGE}))
        return EXIT_USAGE
    from extraction.canary.check import run_canary
    from extraction.canary.result import write_record

    result = run_canary(
        cfg,
        args.samples,
        args.tolerance,
        batch_tolerance=args.batch_tolerance,
        log=lambda m: print(f"hsx canary: {m}", file=sys.stderr, flush=True),
    )
    if not args.no_record:
        old = os.umask(NO_OTHERS)
        os.umask(old | NO_OTHERS)
        try:
            write_record(result)
        finally:
            os.umask(old)
    print(f"hsx canary: {result.state}: {result.message} ({result.seconds:.1f} s)", file=sys.stderr)
    if result.record_error:
        print(f"hsx canary: {result.record_error}", file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict(), sort_keys=True))
    return result.exit_code
