"""A trainer-ready view of finished extractions: links named the way SpecForge names its files.

SpecForge's offline trainer (`scripts/train_eagle3.py --train-hidden-states-path DIR`) walks DIR
recursively and keeps only names ending in `.ckpt`/`.ckpt.gz` (`list_local_files` in
sgl-project/SpecForge `specforge/data/preprocessing.py`); our shards end in `.pt`. Its own
writer (`scripts/prepare_hidden_states.py`, `_get_file_path`) names sample `idx`
`rows_{g}-{g + file_group_size}/data_{idx}.ckpt` with `g = idx // file_group_size *
file_group_size` and `--file-group-size` 2000 by default. A view is that tree of links, pointing
at verified shards (tensors are never copied), plus::

    DEST/export.json     what the view is: layout, link mode, group size, the run it belongs to
    DEST/mapping.jsonl   append-only: data_i -> sample id, source output, shard path

Numbering is stable: a number, once given, always means the same sample (mapping.jsonl is only
appended to). The mapping supplies nothing but that number: what a link points at is always the
verified index entry of its sample in the given output, never the mapping line's `shard` (a file we
wrote once and someone may have edited since: followed, it could make --link hardlink, run as root,
link any file on the filesystem into the training set). A line whose path disagrees with the
index is reported (`mapping_disagreed`) and corrected by a new line for the same number. A
sample that stops being eligible (quarantined, damaged) loses its link but keeps its number; if it
comes back it gets the same number again.

Crash safety: the mapping line is appended and fsynced before its link is made, links are
made at a temp name and renamed into place, and every run reconciles DEST with the mapping
(missing links made, wrong ones replaced, links of no longer eligible samples and leftovers
removed). A crash at any point leaves a DEST that the next run completes.

The mapping and export.json are read and written in extraction.export.mapping (why plain JSON
lines), the links made, checked and swept in extraction.export.links (why absolute symlinks);
this module verifies the outputs, plans the numbering and commits in that order.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import hsx.verify
from extraction.export.links import (
    DEFAULT_GROUP_SIZE,
    LOCK_NAME,
    apply_links,
    check_groups,
    link_relpath,
    probe_hardlink,
)
from extraction.export.mapping import (
    MAPPING_NAME,
    META_NAME,
    ExportError,
    MappingRecord,
    append_mapping,
    read_mapping,
    read_meta,
    rewrite_mapping,
    write_meta,
)
from extraction.export.report import ExportReport, OutputReport
from hsx.fsutil import open_nofollow
from hsx.index import IndexEntry, load_index
from hsx.layout import MANIFEST_NAME
from hsx.manifest import ManifestError, RunManifest, manifest_mismatches, read_manifest_dict
from hsx.verify import LEVELS, VerifyReport

LAYOUTS = ("specforge",)
LINK_MODES = ("symlink", "hardlink")


def _run_identity(manifest: dict[str, Any], source: str) -> RunManifest:
    return RunManifest.from_dict({k: v for k, v in manifest.items() if k != "extra"}, source)


# --- verification -----------------------------------------------------------------------------
def _verify(output: str, level: str, workers: int) -> VerifyReport:
    if level == "deep":  # needs torch: only then import the torch-based verifier
        from extraction.shards.verify import verify_output

        return verify_output(output, level, workers=workers)
    return hsx.verify.verify_output(output, level, workers=workers)


def _eligible(index: dict[str, IndexEntry], report: VerifyReport) -> dict[str, IndexEntry]:
    """The entries of an index snapshot taken before verifying whose shards passed.

    The snapshot must predate the verification: the writer renames a shard into place before
    it appends its index line, so every shard the snapshot names was on disk when the verifier
    listed the directory, and a sample finished while we verified is left for the next run.
    """
    bad_paths = {b.path for b in report.bad}
    missing, unindexed = set(report.missing), set(report.unindexed)
    return {
        sid: e
        for sid, e in index.items()
        if sid not in missing and e.path not in bad_paths and e.path not in unindexed
    }


# --- the export -------------------------------------------------------------------------------
def _check_dest(dest: str, outputs: Sequence[str]) -> None:
    for out in outputs:
        if dest == out or dest.startswith(out + os.sep) or out.startswith(dest + os.sep):
            raise ExportError(f"view {dest} and output {out} must not contain each other")
    if os.path.lexists(dest) and not os.path.isdir(dest):
        raise ExportError(f"{dest}: exists and is not a directory")


def export_view(
    outputs: Sequence[str],
    dest: str,
    *,
    layout: str = "specforge",
    link: str | None = None,
    level: str = "full",
    group_size: int | None = None,
    workers: int = 1,
    log: Callable[[str], None] = lambda _m: None,
) -> ExportReport:
    """Build or update the view at `dest` of the verified shards of `outputs`.

    Raises ExportError (or ManifestError) for usage and I/O problems; then DEST is unchanged.
    """
    started = time.monotonic()
    if layout not in LAYOUTS:
        raise ExportError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if link is not None and link not in LINK_MODES:
        raise ExportError(f"link must be one of {', '.join(LINK_MODES)}, got {link!r}")
    if level not in LEVELS:
        raise ExportError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")
    if group_size is not None and group_size < 1:
        raise ExportError(f"group size must be at least 1, got {group_size}")
    if not outputs:
        raise ExportError("no OUTPUT given")
    real_outputs: list[str] = []
    for out in outputs:
        if not os.path.isdir(out):
            raise ExportError(f"{out}: not a directory")
        r = os.path.realpath(out)
        if r not in real_outputs:
            real_outputs.append(r)
    dest = os.path.abspath(dest)
    dest_real = os.path.realpath(dest)
    _check_dest(dest_real, real_outputs)

    # The run every output must belong to (refuse to mix runs in one training set).
    runs = {}
    for out in real_outputs:
        runs[out] = read_manifest_dict(out)
    first = real_outputs[0]
    base = _run_identity(runs[first], os.path.join(first, MANIFEST_NAME))
    for out in real_outputs[1:]:
        diff = manifest_mismatches(base, _run_identity(runs[out], os.path.join(out, MANIFEST_NAME)))
        if diff:
            raise ExportError(f"{out} and {first} are different runs: " + "; ".join(diff))

    created_dest = not os.path.lexists(dest)
    if created_dest:
        os.makedirs(dest)
    lock_path = os.path.join(dest, LOCK_NAME)
    created_lock = not os.path.lexists(lock_path)
    try:  # never through a link put at its name (hsx.fsutil.LinkRefused)
        lock_fd = open_nofollow(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        _undo_fresh(dest, created_dest, False)
        raise ExportError(f"{dest}: cannot create its lock file: {e.strerror or e}") from None
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            created_dest = created_lock = False  # not ours to clean up
            raise ExportError(f"{dest}: another hsx export-view is updating this view") from None
        report = _export_locked(real_outputs, dest, base, layout, link, level, group_size, workers, log)
    except BaseException:
        if not os.path.exists(os.path.join(dest, META_NAME)):
            _undo_fresh(dest, created_dest, created_lock)
        raise
    finally:
        os.close(lock_fd)
    report.seconds = time.monotonic() - started
    return report


def _undo_fresh(dest: str, created_dest: bool, created_lock: bool) -> None:
    """After a failure before the view existed: remove the lock and DEST this run created."""
    try:
        if created_lock:
            os.unlink(os.path.join(dest, LOCK_NAME))
        if created_dest:
            os.rmdir(dest)  # fails, harmlessly, unless empty
    except OSError:
        pass


def _export_locked(
    outputs: list[str],
    dest: str,
    base: RunManifest,
    layout: str,
    link: str | None,
    level: str,
    group_size: int | None,
    workers: int,
    log: Callable[[str], None],
) -> ExportReport:
    meta = read_meta(dest)
    if meta is None:
        foreign = sorted(n for n in os.listdir(dest) if n != LOCK_NAME)
        if foreign:
            raise ExportError(
                f"{dest}: not empty and not an export view (no {META_NAME}; found {', '.join(foreign[:5])}"
                f"{' ...' if len(foreign) > 5 else ''}); refusing to write into it"
            )
    else:
        if meta.get("layout") != layout:
            raise ExportError(f"{dest}: is a {meta.get('layout')!r} view, not {layout!r}")
        if link is not None and meta.get("link") != link:
            raise ExportError(
                f"{dest}: was built with --link {meta.get('link')}; rebuild it into a new DEST to change"
            )
        if group_size is not None and meta.get("group_size") != group_size:
            raise ExportError(f"{dest}: was built with group size {meta.get('group_size')}, not {group_size}")
        diff = manifest_mismatches(_run_identity(meta.get("run") or {}, os.path.join(dest, META_NAME)), base)
        if diff:
            raise ExportError(f"{dest}: holds a view of a different run: " + "; ".join(diff))
    link = meta["link"] if meta else (link or "symlink")
    group_size = int(meta["group_size"]) if meta else (group_size or DEFAULT_GROUP_SIZE)
    report = ExportReport(dest=dest, layout=layout, link=link, level=level, group_size=group_size)

    records, torn = read_mapping(dest)
    report.mapping_torn_tail = torn

    # 1. Verify every output; an I/O error anywhere stops everything (not evidence of bad data).
    eligible: dict[str, dict[str, IndexEntry]] = {}
    for out in outputs:
        log(f"verifying {out} ({level})")
        snapshot = load_index(out)
        vr = _verify(out, level, workers)
        if vr.errors:
            raise ExportError(
                f"{out}: I/O errors while verifying, nothing changed: " + "; ".join(vr.errors[:3])
            )
        report.outputs.append(
            OutputReport(out, vr.checked, vr.ok, vr.bad, vr.missing, len(vr.unindexed), vr.index_bad_lines)
        )
        eligible[out] = _eligible(snapshot, vr)

    # 2. Plan: numbered samples keep their number; new ones get the next numbers.
    given = set(outputs)
    appended: list[MappingRecord] = []
    want: dict[int, MappingRecord | None] = {}  # number -> record to link, or None to unlink
    reasons: dict[int, str] = {}
    source: dict[str, str] = {}  # sample id -> the output its number links to (this run)
    for i, rec in sorted(records.items()):
        if rec.output in given and rec.sample_id in eligible[rec.output]:
            verified = eligible[rec.output][rec.sample_id].path
            if rec.shard == verified:
                want[i] = rec
            else:  # the mapping only numbers the sample; where its shard is, the index says
                want[i] = MappingRecord(i, rec.sample_id, rec.output, verified)
                appended.append(want[i])
                report.mapping_disagreed.append(
                    {"i": i, "id": rec.sample_id, "output": rec.output, "mapping_shard": rec.shard,
                     "shard": verified}
                )
                log(
                    f"{MAPPING_NAME}: data_{i} ({rec.sample_id!r}) names shard {rec.shard!r}, the verified "
                    f"index of {rec.output} says {verified!r}: not followed; linking the index's shard"
                )
        elif (other := next((o for o in outputs if rec.sample_id in eligible[o]), None)) is not None:
            want[i] = MappingRecord(i, rec.sample_id, other, eligible[other][rec.sample_id].path)
            appended.append(want[i])
            report.repointed += 1
        elif rec.output in given:
            want[i] = None
            reasons[i] = _why_not(rec, report)
        else:
            report.not_rechecked += 1
        source[rec.sample_id] = want[i].output if want.get(i) else rec.output
    first_new = next_i = max(records) + 1 if records else 0
    for out in outputs:
        for sid in sorted(eligible[out]):
            if sid in source:
                if source[sid] != out:
                    report.duplicates.append({"id": sid, "output": out})
                continue
            want[next_i] = MappingRecord(next_i, sid, out, eligible[out][sid].path)
            appended.append(want[next_i])
            source[sid] = out
            next_i += 1
    report.added = next_i - first_new

    # 3. Preflight what could fail half-way: a group folder that is a link (not followed), hard
    # links across filesystems.
    check_groups(dest, want, group_size)
    if link == "hardlink":
        for out in outputs:
            sample = next((r for r in want.values() if r is not None and r.output == out), None)
            if sample is not None:
                probe_hardlink(sample, dest)

    # 4. Commit: metadata, then mapping (write-ahead), then links.
    if meta is None:
        write_meta(dest, layout, link, group_size, base)
    if torn:
        rewrite_mapping(dest, records)
    append_mapping(dest, appended)
    for rec in appended:
        records[rec.i] = rec
    apply_links(dest, records, want, reasons, first_new, report)
    report.numbered = len(records)
    return report


def _why_not(rec: MappingRecord, report: ExportReport) -> str:
    out = next(o for o in report.outputs if o.output == rec.output)
    for b in out.bad:
        if b.sample_id == rec.sample_id or b.path == rec.shard:
            return f"failed {report.level}: {b.reason}"
    if rec.sample_id in out.missing:
        return "indexed but missing on disk"
    return "no longer in the output's index (quarantined or removed)"


__all__ = [
    "DEFAULT_GROUP_SIZE",
    "LAYOUTS",
    "LINK_MODES",
    "MAPPING_NAME",
    "META_NAME",
    "ExportError",
    "ExportReport",
    "ManifestError",
    "MappingRecord",
    "export_view",
    "link_relpath",
    "read_mapping",
    "read_meta",
]
