"""`hsx export-view OUTPUT [OUTPUT...] DEST --layout specforge`: a trainer-ready view of shards."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from extraction.export.view import (
    DEFAULT_GROUP_SIZE,
    LAYOUTS,
    LINK_MODES,
    ExportError,
    ExportReport,
    export_view,
)
from hsx.exitcodes import EXIT_USAGE
from hsx.verify import LEVELS, ManifestError, default_workers


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "export-view",
        help="link verified shards into a directory a trainer (SpecForge) reads",
        usage="hsx export-view OUTPUT [OUTPUT ...] DEST --layout specforge [options]",
        description=(
            "Build or update DEST as a tree of links to the verified shards of one or more "
            "outputs (several nodes of one run), named the way SpecForge's own writer names its "
            "files (rows_{a}-{b}/data_{i}.ckpt), with DEST/mapping.jsonl tracing every data_i "
            "back to its sample id, output and shard. Tensors are never copied. Re-running adds "
            "newly finished samples; existing numbers keep their sample. Shards failing the "
            "chosen verification level are left out. Exit 0 all eligible shards linked, 1 some "
            "left out as bad or missing, 2 usage or I/O error (then DEST is unchanged)."
        ),
    )
    p.add_argument(
        "paths", nargs="+", metavar="PATH", help="output directories (OUTPUT), then the view (DEST)"
    )
    p.add_argument("--layout", choices=LAYOUTS, required=True, help="whose file naming to follow")
    p.add_argument(
        "--link",
        choices=LINK_MODES,
        default=None,
        help="symlink (default for a new view; absolute targets) or hardlink (same filesystem only); "
        "an existing view keeps the mode it was built with",
    )
    p.add_argument(
        "--only-verified",
        choices=LEVELS,
        default="full",
        dest="level",
        help="verification level a shard must pass to be linked (default full: CRC of every byte)",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        help=f"files per rows_a-b folder (default {DEFAULT_GROUP_SIZE}, SpecForge's --file-group-size)",
    )
    p.add_argument("--workers", type=int, default=default_workers(), help="parallel verify workers")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if len(args.paths) < 2:
        print("hsx export-view: give at least one OUTPUT and a DEST", file=sys.stderr)
        return EXIT_USAGE
    if args.workers < 1:
        print("hsx export-view: --workers must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    *outputs, dest = args.paths
    log = (lambda _m: None) if args.json else (lambda m: print(m, file=sys.stderr))
    try:
        report: ExportReport = export_view(
            outputs,
            dest,
            layout=args.layout,
            link=args.link,
            level=args.level,
            group_size=args.group_size,
            workers=args.workers,
            log=log,
        )
    except (ExportError, ManifestError) as e:
        print(f"hsx export-view: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        where = " -> ".join(str(x) for x in (e.filename, e.filename2) if x) or dest
        print(f"hsx export-view: {where}: {e.strerror or e} (re-run to complete the view)", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        _summary(report)
    return report.exit_code


def _summary(r: ExportReport) -> None:
    print(
        f"{r.dest}: {r.layout} view ({r.link}s, {r.level}-verified), {r.linked} linked of "
        f"{r.numbered} numbered samples in {r.seconds:.1f}s"
    )
    print(f"  added {r.added}, relinked {r.relinked}, re-pointed {r.repointed}, unlinked {len(r.unlinked)}")
    for o in r.outputs:
        print(
            f"  {o.output}: ok {o.ok} of {o.checked}, bad {len(o.bad)}, missing {len(o.missing)}, "
            f"unindexed {o.unindexed} (not linked)"
        )
        for b in o.bad[:10]:
            print(f"    left out: {b.path} ({b.sample_id}): {b.reason}")
        if len(o.bad) > 10:
            print(f"    ... and {len(o.bad) - 10} more bad shards (use --json for all)")
        for sid in o.missing[:10]:
            print(f"    left out: {sid}: indexed, not on disk")
    for u in r.unlinked[:10]:
        print(f"  unlinked data_{u['i']} ({u['id']}): {u['reason']}")
    if r.duplicates:
        print(f"  {len(r.duplicates)} samples found in more than one output: one copy linked")
    if r.not_rechecked:
        print(
            f"  {r.not_rechecked} numbered samples come from outputs not given this time: left as they were"
        )
    if r.leftovers_removed:
        print(f"  removed {len(r.leftovers_removed)} leftovers of an interrupted export")
    if r.unknown:
        print(f"  left alone (not part of the view): {', '.join(r.unknown[:5])}")
    if r.left_out_bad:
        print(f"  {r.left_out_bad} shards left out as bad or missing (see `hsx verify --quarantine`)")
