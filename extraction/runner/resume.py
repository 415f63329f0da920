"""Resume: this run's manifest, the output made ready for it, and what is already done there.

Contract:
- `load_inputs` reads the model's config, the capture layers, the dataset (one scan: ids,
  offsets, row errors, hash) and the tokenizer, and builds the run's manifest (run.json). It
  writes nothing; a bad input is a RunError.
- The token bound (`token_bound`): --max-length, else the model's context; a longer sample is cut
  to it. run.json's extra records it (`token_bound`). A resume may tighten it (`check_bound`):
  samples already done keep theirs (they were within the old bound), new ones are cut at the new
  one, and the change goes to extra's `bound_history` (written by `update_run_json` once the run
  can start). Loosening it is refused: the output would hold samples cut at two bounds silently.
- The bucket count (`run_buckets`): run.json's when the output has one (a different --buckets
  is refused), else --buckets or hsx.buckets.DEFAULT_BUCKETS for a new run; None for a run.json
  made before buckets, which resumes by --shard-index/--num-shards only (--assign/--buckets are
  refused there). --assign is checked against it; the assignment itself is not in run.json.
- `open_output` takes the output's lock before anything there is written or removed, then opens
  the shard writer, which refuses an output whose run.json differs from the manifest (RunError,
  nothing written; every refusal says what to do next) and leaves a new output's run.json to
  `writer.commit_manifest()`, which the runner calls once the run can start (the backend loaded
  and checked); it ends a torn last index line and removes
  the temp files an interrupted writer left. A full disk here is a pause (exit 75).
- `verified_done`: the samples whose shard is indexed at its own shard path (hsx.index.entry_problems,
  the rule `hsx verify` applies) AND passes the `quick` check; any other indexed sample is recorded
  (errors.jsonl, kind "resume") and redone. Nothing unindexed counts as done.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from extraction.inputs import layers as layer_mod
from extraction.inputs.chat_tokenizer import (
    ChatTokenizer,
    chat_template_of,
    load_tokenizer,
    sha256_text,
    tokenizer_hash,
)
from extraction.inputs.config import ExtractConfig
from extraction.inputs.dataset import DatasetScan, scan_dataset
from extraction.inputs.preflight import InputError, check_inputs
from extraction.process.outputlock import OutputBusy, OutputLock
from extraction.runner.lifecycle import RunError
from extraction.shards import ManifestMismatchError, ShardWriter
from hsx.buckets import DEFAULT_BUCKETS, AssignError, check_buckets, parse_assign
from hsx.errors import ShardBad, ShardIOError
from hsx.exitcodes import EXIT_FAILED, EXIT_PAUSED, EXIT_USAGE
from hsx.fsutil import LinkRefused, nofollow_opener
from hsx.index import entry_problems, read_index
from hsx.layout import INDEX_NAME, MANIFEST_NAME, SHARDS_DIR
from hsx.manifest import (
    ManifestError,
    RunManifest,
    check_fingerprints,
    read_manifest,
    read_manifest_dict,
    write_manifest,
)
from hsx.status import now_iso
from hsx.verify import Expect, check_shard

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass
class RunInputs:
    """What the run reads before it touches the output."""

    model_cfg: dict[str, Any]  # hidden_size, num_layers, vocab_size, max_positions
    layer_ids: list[int]
    scan: DatasetScan
    tokenizer: ChatTokenizer
    manifest: RunManifest
    bound_change: dict[str, Any] | None = None  # a tightened token bound, for run.json's history


def token_bound(cfg: ExtractConfig, model_cfg: dict[str, Any]) -> int:
    """The most tokens a sample has: --max-length when given, else the model's context, which is
    config.json's max_position_embeddings (the positions the model was built for; a tokenizer's
    model_max_length is often a placeholder such as 1e30, so it is not used), or UNTRUNCATED_TOKENS
    where config.json names none. A longer sample is cut to it, never refused: its start is still
    what the drafter trains on; the cut is recorded per sample when the bound is the default."""
    return cfg.max_length or model_cfg["max_positions"]


def load_inputs(cfg: ExtractConfig) -> RunInputs:
    """The run's inputs and manifest (see the module's contract)."""
    try:
        model_cfg, layer_ids = check_inputs(cfg)
    except InputError as e:
        raise RunError(str(e)) from None
    scan = scan_dataset(cfg.dataset, cfg.max_row_bytes)
    try:
        tokenizer = load_tokenizer(cfg.model)
    except Exception as e:
        raise RunError(f"cannot load the tokenizer from {cfg.model}: {e}") from None
    if chat_template_of(tokenizer) is None:
        raise RunError(f"{cfg.model}: the tokenizer has no chat template")
    bound = token_bound(cfg, model_cfg)
    manifest = build_manifest(cfg, model_cfg, layer_ids, tokenizer, scan.sha256, bound)
    change = check_bound(cfg.output, manifest)
    manifest.buckets = run_buckets(cfg)
    return RunInputs(model_cfg, layer_ids, scan, ChatTokenizer(tokenizer, bound), manifest, change)


def build_manifest(
    cfg: ExtractConfig,
    model_cfg: dict[str, Any],
    layer_ids: list[int],
    tokenizer: Any,
    ds_hash: str,
    bound: int | None = None,
) -> RunManifest:
    from extraction.backends.hf import model_revision

    return RunManifest(
        model=os.path.basename(os.path.abspath(cfg.model)),
        revision=model_revision(cfg.model),
        hidden_size=model_cfg["hidden_size"],
        num_layers=model_cfg["num_layers"],
        layer_ids=layer_ids,
        layer_convention=layer_mod.CANONICAL,
        dtype=DTYPE_NAMES[cfg.dtype],
        final_normed=True,
        vocab_size=model_cfg["vocab_size"],
        tokenizer_hash=tokenizer_hash(cfg.model),
        chat_template_hash=sha256_text(chat_template_of(tokenizer)),
        dataset_path=os.path.basename(cfg.dataset),
        dataset_hash=ds_hash,
        extra={
            "max_length": cfg.max_length,
            "token_bound": bound if bound is not None else token_bound(cfg, model_cfg),
            "model_dir": os.path.abspath(cfg.model),
            "dataset_file": os.path.abspath(cfg.dataset),
            "backend": cfg.backend,
            "batch_size": cfg.batch_size,
            "host": socket.gethostname(),
        },
    )


def check_bound(output: str, manifest: RunManifest) -> dict[str, Any] | None:
    """The token bound against the one the output's run.json records (see the module's contract):
    None when it is the same (or the output is new), the change when it is tighter (also put into
    `manifest.extra["bound_history"]`); RunError when it is looser. A run.json without
    `token_bound` (written before the default bound) holds its --max-length as its bound, None
    for none."""
    path = os.path.join(output, MANIFEST_NAME)
    if not os.path.exists(path):
        return None
    try:
        extra = read_manifest_dict(output).get("extra")
    except ManifestError as e:
        raise RunError(f"{e}; use another --output, or move the output aside if it is not a run") from None
    extra = extra if isinstance(extra, dict) else {}
    old = extra["token_bound"] if "token_bound" in extra else extra.get("max_length")
    new = manifest.extra["token_bound"]
    history = extra.get("bound_history")
    manifest.extra["bound_history"] = list(history) if isinstance(history, list) else []
    if old == new:
        return None
    if old is not None and (isinstance(old, bool) or not isinstance(old, int) or new > old):
        raise RunError(
            f"refusing to resume: {output} holds a different run: max_length: the existing run cuts "
            f"samples at {old!r} tokens, this run would allow {new} (samples cut at two bounds in one "
            f"output): rerun with --max-length {old!r} (or lower), or use another --output"
        )
    change = {"at": now_iso(), "from": old, "to": new}
    manifest.extra["bound_history"].append(change)
    return change


def run_buckets(cfg: ExtractConfig) -> int | None:
    """The run's bucket count (see the module's contract); RunError saying what to do for a
    --buckets other than run.json's, --assign on an output made before buckets, or an --assign
    naming a bucket the run does not have."""
    output = cfg.output
    if not os.path.lexists(os.path.join(output, MANIFEST_NAME)):
        buckets: int | None = cfg.buckets or DEFAULT_BUCKETS
    else:
        try:
            buckets = read_manifest_dict(output).get("buckets")
        except ManifestError as e:
            raise RunError(f"{e}; use another --output, or move the output aside if it is not a run") from None
        if buckets is None and (cfg.assign is not None or cfg.buckets is not None):
            raise RunError(
                f"refusing to resume: {output} was made before buckets (its run.json records no bucket "
                "count: its nodes split the dataset by --shard-index/--num-shards): resume it as it was "
                "made, without --buckets/--assign (the roles: set hsx_shard_index/hsx_num_shards for this "
                "host), or extract into another --output"
            )
        if buckets is not None and cfg.buckets is not None and cfg.buckets != buckets:
            raise RunError(
                f"refusing to resume: {output} holds a run of {buckets!r} buckets, this run asks for "
                f"--buckets {cfg.buckets} (the bucket count is fixed when a run is made): drop --buckets "
                f"(or give {buckets!r}), or use another --output"
            )
    if buckets is None:
        return None
    try:
        check_buckets(buckets, os.path.join(output, MANIFEST_NAME))
    except AssignError as e:
        raise RunError(f"{e}; use another --output, or move the output aside if it is not a run") from None
    if cfg.assign is not None:
        try:
            parse_assign(cfg.assign, buckets)
        except AssignError as e:
            raise RunError(f"--assign: {e}; give buckets of this run (0-{buckets - 1})") from None
    return buckets


def update_run_json(output: str, manifest: RunManifest) -> None:
    """Record a tightened token bound in the output's run.json (its extra's max_length,
    token_bound and bound_history); every other field as it is there."""
    existing = read_manifest(output)
    keys = ("max_length", "token_bound", "bound_history")
    existing.extra = {**existing.extra, **{k: manifest.extra[k] for k in keys}}
    write_manifest(output, existing)


def make_output_dir(output: str) -> None:
    """The output directory, made if absent; its parent must exist (RunError otherwise): a
    mistyped --output (/dtaa/run) is a typo to fix, not a tree to make."""
    try:
        os.mkdir(output, 0o777)
    except FileExistsError:
        return
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(output))
        raise RunError(
            f"--output {output}: its parent directory {parent} does not exist; check the path for a typo, "
            "or create the parent first (hsx makes only the output directory itself)"
        ) from None


def open_output(
    output: str, manifest: RunManifest, lock: OutputLock, log: Callable[[str], None]
) -> ShardWriter:
    """Lock the output, open its shard writer (run.json checked or written), end a torn index
    line, remove orphan temps (see the module's contract)."""
    try:
        make_output_dir(output)
        unlocked = lock.acquire()  # before anything here writes to the output or removes from it
        if unlocked:
            log(unlocked)
    except OutputBusy as e:
        raise RunError(f"{e}: wait for it to end (hsx status {output}), or use another --output", EXIT_FAILED) from None
    except OSError as e:  # a full disk is a pause here too: the job unit leaves it to a person
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        raise RunError(f"--output {output}: {e}", EXIT_PAUSED if full else EXIT_USAGE) from None
    try:
        # The NaN/Inf check is the publisher's (Item.nonfinite): on the device when the backend can.
        writer = ShardWriter(output, manifest, check_finite=False, defer_manifest=True)
    except ManifestMismatchError as e:
        raise RunError(
            f"refusing to resume: {e}: to extract with these options, use another --output; to go on with "
            f"this run, use the options its {os.path.join(output, MANIFEST_NAME)} records"
        ) from None
    except ManifestError as e:
        raise RunError(
            f"refusing to start: {e}: use another --output, or move {os.path.join(output, MANIFEST_NAME)} "
            "aside if that output holds no run you want to keep"
        ) from None
    except LinkRefused as e:  # its message says what to remove
        raise RunError(f"--output {output}: {e}") from None
    except OSError as e:
        raise RunError(f"--output {output}: {e}") from None
    if not writer.writes_directly:
        log(f"shards written by torch.save ({writer.write_mode}): slower, same bytes")
    try:
        end_torn_index_line(output)
        removed = writer.remove_orphan_temps()
    except OSError as e:  # a link or FIFO at the index (LinkRefused says what to remove), an I/O error
        writer.close()
        raise RunError(f"--output {output}: {e}") from None
    if removed:
        log(f"removed {removed} temp file(s) left by an interrupted writer")
    return writer


def remove_empty_shards_dir(output: str) -> None:
    """A start that failed on a new output: take back the empty shards/ the writer made (never
    through a link, never a folder with anything in it: rmdir refuses both)."""
    try:
        os.rmdir(os.path.join(output, SHARDS_DIR))
    except OSError:
        pass


def end_torn_index_line(output_dir: str) -> None:
    """A crash mid-append can leave the index without its final newline; the next append would
    then be glued to the fragment and lost with it. End the fragment with a newline first, so it
    stays a single damaged line that read_index skips. An index that is a link is refused
    (hsx.fsutil.LinkRefused)."""
    path = os.path.join(output_dir, INDEX_NAME)
    try:
        with open(path, "rb+", opener=nofollow_opener) as f:  # never through a link (root)
            if f.seek(0, os.SEEK_END) == 0:
                return
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
                f.flush()
                os.fsync(f.fileno())
    except FileNotFoundError:
        return


def verified_done(
    output: str, manifest: RunManifest, wanted: set[str], record: Callable[[dict[str, Any]], None]
) -> tuple[set[str], int]:
    """Samples of `wanted` whose shard is indexed at its own shard path and passes `quick`; plus
    how many indexed ones did not (each `record`ed for errors.jsonl). Which entries can count at
    all is hsx.index.entry_problems, the rule `hsx verify` applies: never a path outside shards/,
    another sample's shard, or one that two entries name."""
    state = read_index(output)
    expect = Expect.from_manifest(manifest.to_dict())
    try:  # shards written under another run.json are no one's done work: refuse, move nothing
        check_fingerprints(output, expect.fingerprint, (e.fingerprint for e in state.entries.values()))
    except ManifestError as e:
        raise RunError(f"refusing to resume: {e}") from None
    untrusted = entry_problems((sid, e.path) for sid, e in state.entries.items())
    done: set[str] = set()
    bad = 0
    for sid, entry in state.entries.items():
        if sid not in wanted:
            continue
        why = untrusted.get(sid)
        if why is None:
            try:
                check_shard(os.path.join(output, entry.path), expect, "quick", entry)
            except (ShardBad, ShardIOError) as e:
                why = str(e)
        if why is not None:
            bad += 1
            record({"kind": "resume", "sample_id": sid, "reason": f"redo: {why}"})
            continue
        done.add(sid)
    return done, bad
