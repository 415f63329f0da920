"""`hsx verify OUTPUT`: check every shard of a run, reconcile with the index, quarantine if asked."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hsx.exitcodes import EXIT_USAGE
from hsx.verify import LEVELS, ManifestError, VerifyReport, default_workers


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "verify",
        help="verify the shards of an output directory",
        description=(
            "Verify every shard of a run without trusting the files: quick = zip structure and "
            "pickled metadata (no torch, nothing executed), full = + CRC32 of every byte and the "
            "index checksums, deep = + load tensors and check values. Exit 0 all good, 1 bad or "
            "missing shards, 2 usage or I/O error (then nothing is moved)."
        ),
    )
    p.add_argument("output", help="the run's output directory (holds run.json)")
    p.add_argument(
        "--level",
        choices=LEVELS,
        default="quick",
        help="how deep to check; quick is the default here (seconds, what a resume trusts), while "
        "recover.yml's shard_verify module defaults to full (unattended after a crash, where every "
        "byte's CRC is worth the read): pass --level full to check as a recovery does",
    )
    p.add_argument(
        "--quarantine",
        action="store_true",
        help="move bad shards to OUTPUT/quarantine/ (with a reason file), mark bad and missing "
        "samples not done in the index, delete stale writer temp files",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    p.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help="parallel workers (default: cores - 1, at most 16; here %(default)s)",
    )
    p.add_argument(
        "--orphan-age",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="with --quarantine, delete temp files older than this (younger ones may be a live writer's)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        print("hsx verify: --workers must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    from extraction.shards.verify import verify_output

    bar = _progress_bar() if not args.json and sys.stderr.isatty() else None
    try:
        report = verify_output(
            args.output,
            args.level,
            quarantine=args.quarantine,
            workers=args.workers,
            progress=bar.update if bar else None,
            orphan_min_age=args.orphan_age,
        )
    except ManifestError as e:
        print(f"hsx verify: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"hsx verify: {e.filename or args.output}: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if bar:
            bar.close()
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        _summary(report, args.output)
    return report.exit_code


def _summary(r: VerifyReport, output: str) -> None:
    mib = r.bytes / (1 << 20)
    print(f"{output}: {r.level} check of {r.checked} shards in {r.seconds:.1f}s ({mib:.0f} MiB read)")
    print(f"  ok {r.ok}, bad {len(r.bad)}, missing {len(r.missing)}, unindexed {len(r.unindexed)}")
    for b in r.bad[:20]:
        print(f"  bad: {b.path} ({b.sample_id}): {b.reason}")
    if len(r.bad) > 20:
        print(f"  ... and {len(r.bad) - 20} more bad shards (use --json for all)")
    for sid in r.missing[:10]:
        print(f"  missing: {sid} (indexed, not on disk)")
    if r.orphans:
        print(f"  temp files: {len(r.orphans)} found, {r.orphans_removed} removed")
    if r.quarantined:
        print(f"  quarantined {len(r.quarantined)} shards into {output}/quarantine/")
    elif (r.bad or r.missing) and not r.errors:
        print("  nothing moved (run with --quarantine to move bad shards aside and mark them not done)")
    for e in r.errors:
        print(f"  error: {e}", file=sys.stderr)
    if r.errors:
        print("  I/O errors: nothing was moved", file=sys.stderr)


class _Bar:
    def __init__(self) -> None:
        from tqdm import tqdm

        self.tqdm = tqdm(total=0, unit="shard", file=sys.stderr, leave=False)

    def update(self, done: int, total: int, _bytes: int) -> None:
        self.tqdm.total = total
        self.tqdm.n = done
        self.tqdm.refresh()

    def close(self) -> None:
        self.tqdm.close()


def _progress_bar() -> _Bar | None:
    try:
        return _Bar()
    except ImportError:
        return None
