"""The canary check: re-extract a few finished samples as the job would, compare them with their shards.

Contract (`run_canary(cfg, k, tolerance)` -> CanaryResult, extraction/canary/result.py):
- Nothing to compare (OUTPUT has no run.json, or its index no live entry): `skipped`, at once,
  before the model or the dataset is read.
- The job's own pieces, so the canary computes as the job does: the config (`cfg`, the job's
  config file), the inputs and run.json's manifest (runner/resume.py load_inputs: model, layers,
  dataset scan, tokenizer, token bound, buckets), the backend (runner/forward.py make_backend and
  check_backend: hf in process on cfg.device, or the job's SGLang server), torch's CPU threads
  (runner/forward.py forward_threads; a rebuilt batch on the CPU runs on the threads its line
  records).
- Each chosen sample is re-run in its ORIGINAL batch where OUTPUT/batches.jsonl says what it was
  (extraction/canary/rebuild.py: the batch's rows in their order, so the same padding and shape;
  every batch forwarded once) and held to `batch_tolerance` (default 0: bit-equal states). Where it
  cannot be rebuilt (no batch log: shards written before batch recording; no line for it; the
  sglang backend; another device) it runs alone, as before, held to `tolerance` (None: the run's
  dtype's default, settings.tolerance_for), and its result says why. Each row is tokenized with the
  job's chat tokenizer, cut at the larger of the run's token bound and its recorded (alone: its
  shard's) length (a sample done before a resume tightened the bound was cut at the old one). A row
  of a rebuilt batch that tokenizes to another length than its line records is a mismatch of the
  batch's chosen samples (this node tokenizes differently). A batch log line whose CRC holds but is
  not a batch record is an `error` naming the file and the line (data we did not write).
- Cost: `forwarded` (rows run through the model: K whole batches, not K samples) and the seconds.
- Inputs the job would refuse are an `error` saying so (the configured inputs make another run
  than run.json describes: its fingerprint differs).
- Which samples: extraction/canary/pick.py. Each chosen shard must pass `full` (every record's
  CRC32) and load (torch.load, weights_only): a missing, bad or unloadable one is an `error` naming
  the sample and the file; an indexed sample the dataset no longer holds likewise.
- The verdict per sample: extraction/canary/compare.py; `tolerance` None: the default of the run's
  dtype (settings.tolerance_for); 0 demands bit-equal states.
- Read-only on OUTPUT: it reads run.json, index.jsonl, buckets.json and the chosen shards, takes no
  lock and writes nothing there (the record, OUTPUT/canary.json, is `hsx canary`'s: result.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

import torch

from extraction.backends.base import Backend, Sample
from extraction.canary.compare import SampleCheck, compare_sample
from extraction.canary.pick import pick_samples
from extraction.canary.rebuild import Run, plan_runs, tokenize_run
from extraction.canary.result import CanaryResult
from extraction.canary.settings import DEFAULT_BATCH_TOLERANCE, DEFAULT_SAMPLES, tolerance_for
from extraction.inputs.config import ExtractConfig
from extraction.inputs.dataset import RowError
from extraction.runner.batchlog import BatchLogError, BatchLogState, last_batches, read_batch_log
from extraction.runner.forward import check_backend, forward_threads, make_backend
from extraction.runner.lifecycle import RunError
from extraction.runner.publish import default_writer_threads
from extraction.runner.resume import RunInputs, load_inputs
from extraction.shards.filebytes import in_memory
from hsx.errors import ShardBad, ShardIOError
from hsx.exitcodes import EXIT_FAILED, EXIT_USAGE
from hsx.index import IndexEntry, read_index
from hsx.layout import MANIFEST_NAME, SHARD_KEYS
from hsx.manifest import (
    FINGERPRINT_FIELDS,
    ManifestError,
    RunManifest,
    manifest_fingerprint,
    manifest_mismatches,
    read_manifest_dict,
)
from hsx.verify import Expect, check_shard


class CanaryError(Exception):
    """The check cannot be made; `code` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_FAILED):
        super().__init__(message)
        self.code = code


def run_canary(
    cfg: ExtractConfig,
    k: int = DEFAULT_SAMPLES,
    tolerance: float | None = None,
    *,
    batch_tolerance: float = DEFAULT_BATCH_TOLERANCE,
    backend_factory: Callable[[ExtractConfig, list[int]], Backend] = make_backend,
    log: Callable[[str], None] | None = None,
) -> CanaryResult:
    """The canary on `cfg`'s output (see the module's contract); never raises for a bad input."""
    if k < 1:
        raise ValueError(f"the canary needs at least one sample, got {k}")
    t0 = time.monotonic()
    device = cfg.device if cfg.backend == "hf" else cfg.server_url
    result = CanaryResult("error", "", str(cfg.output), requested=k, backend=cfg.backend, device=device)
    result.batch_tolerance = batch_tolerance
    try:
        _check(cfg, k, tolerance, backend_factory, log or (lambda _m: None), result)
    except CanaryError as e:
        result.state, result.message, result.error_code = "error", str(e), e.code
    finally:
        result.seconds = time.monotonic() - t0
    return result


def _check(
    cfg: ExtractConfig,
    k: int,
    tolerance: float | None,
    backend_factory: Callable[[ExtractConfig, list[int]], Backend],
    log: Callable[[str], None],
    result: CanaryResult,
) -> None:
    output = str(cfg.output)
    if not os.path.lexists(os.path.join(output, MANIFEST_NAME)):
        result.state, result.message = "skipped", f"{output} holds no run yet (no {MANIFEST_NAME}): nothing to compare"
        return
    try:
        on_disk = read_manifest_dict(output)
        state = read_index(output)
    except (ManifestError, OSError) as e:
        raise CanaryError(f"{output}: {e}", EXIT_USAGE) from None
    if not state.entries:
        result.state, result.message = "skipped", f"{output} has no indexed shard yet: nothing to compare"
        return
    fingerprint = manifest_fingerprint(on_disk)
    try:
        batch_log = read_batch_log(output)
    except (BatchLogError, OSError) as e:
        raise CanaryError(
            f"{e}: the batch log is not one hsx wrote; move it aside to check the samples alone "
            "(within the dtype's bound)",
            EXIT_FAILED,
        ) from None
    result.batch_log = _describe_log(batch_log)
    recorded = set(last_batches(batch_log.records)) if cfg.backend == "hf" else set()
    pick = pick_samples(output, state, fingerprint, k, prefer=recorded)
    result.source, result.candidates = pick.source, pick.candidates
    if not pick.entries:
        raise CanaryError(
            f"{output}: none of its {len(state.entries)} index entries can count as done (another run's "
            "fingerprint, or not at the sample's own shard path): verify it (hsx verify) before resuming"
        )
    inputs = _inputs(cfg, on_disk, fingerprint)
    result.dtype = inputs.manifest.dtype
    result.fallback_tolerance = tolerance if tolerance is not None else tolerance_for(inputs.manifest.dtype)
    shards = {e.sample_id: _load_shard(output, e, on_disk) for e in pick.entries}
    runs = plan_runs(cfg, batch_log, pick.entries, shards)
    batches = [_tokenize(cfg, inputs, r, shards) for r in runs]
    result.forwarded = sum(len(b) for b in batches)
    result.rebuilt = sum(r.record is not None for r in runs)
    log(f"re-extracting {len(pick.entries)} sample(s) from {pick.source} ({pick.candidates} candidates): "
        f"{', '.join(e.sample_id for e in pick.entries)}; {_describe_runs(runs, result.forwarded)}")
    t1 = time.monotonic()
    try:
        backend = backend_factory(cfg, inputs.layer_ids)
    except Exception as e:  # any backend's own failure to start
        raise CanaryError(f"cannot start the {cfg.backend} backend: {type(e).__name__}: {e}") from None
    try:
        try:
            check_backend(backend, inputs.manifest, cfg)
        except RunError as e:
            raise CanaryError(str(e), e.code) from None
        result.model_load_s = time.monotonic() - t1
        t2 = time.monotonic()
        timings: dict[str, float] = {}
        with forward_threads(cfg, default_writer_threads(cfg.backend), log, timings):
            for run, samples in zip(runs, batches, strict=True):
                bound = result.batch_tolerance if run.record is not None else result.fallback_tolerance
                result.samples.extend(_forward_and_compare(backend, run, samples, shards, bound))
        result.forward_s = time.monotonic() - t2
        result.tolerance = max(s.tolerance or 0.0 for s in result.samples)
    finally:
        try:
            backend.close()
        except Exception:  # noqa: BLE001 - the verdict is made; a close that fails changes nothing
            pass
    _conclude(result)


def _inputs(cfg: ExtractConfig, on_disk: dict, fingerprint: str) -> RunInputs:
    """The job's inputs (load_inputs), which must make the run OUTPUT/run.json describes."""
    try:
        inputs = load_inputs(cfg)
    except RunError as e:
        raise CanaryError(f"the job's inputs: {e}", e.code) from None
    if manifest_fingerprint(inputs.manifest.to_dict()) != fingerprint:
        try:
            existing = RunManifest.from_dict(on_disk, os.path.join(str(cfg.output), MANIFEST_NAME))
            why = [m for m in manifest_mismatches(existing, inputs.manifest) if m.split(":", 1)[0] in FINGERPRINT_FIELDS]
        except ManifestError as e:
            why = [str(e)]
        raise CanaryError(
            f"this node's inputs make another run than {cfg.output}/{MANIFEST_NAME} describes "
            f"({'; '.join(why) or 'its fingerprint differs'}): the job would refuse to resume too; put back "
            "the model, tokenizer and settings the run was made with",
            EXIT_FAILED,
        )
    return inputs


def _load_shard(output: str, entry: IndexEntry, on_disk: dict) -> dict[str, torch.Tensor]:
    """A chosen shard, checked `full` and loaded; CanaryError naming it otherwise."""
    path = os.path.join(output, entry.path)
    try:
        check_shard(path, Expect.from_manifest(on_disk), "full", entry)
        data = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except (ShardBad, ShardIOError) as e:
        raise CanaryError(f"sample {entry.sample_id!r}: its shard {path} is not good: {e} (verify the output: hsx verify)") from None
    except Exception as e:  # torch raises many types for a bad file
        raise CanaryError(f"sample {entry.sample_id!r}: its shard {path} does not load: {type(e).__name__}: {e}") from None
    if not isinstance(data, dict) or set(data) != set(SHARD_KEYS):
        raise CanaryError(f"sample {entry.sample_id!r}: its shard {path} is not the four-key shard dict")
    return data


def _tokenize(cfg: ExtractConfig, inputs: RunInputs, run: Run, shards: dict[str, dict[str, torch.Tensor]]) -> list[Sample]:
    """A run's rows through the job's chat tokenizer (see the module's contract)."""
    rows = {e.sample_id: e for e in inputs.scan.entries}
    try:
        return tokenize_run(run, cfg, inputs.tokenizer, rows, shards)
    except KeyError as e:
        missing = e.args[0]
        what = "are indexed" if set(missing) & set(run.checks) else "were in a chosen sample's batch"
        raise CanaryError(
            f"sample(s) {', '.join(map(repr, missing))} {what} in {cfg.output} but not in the dataset "
            f"{cfg.dataset}: the job's dataset is not the one the run was made from",
            EXIT_USAGE,
        ) from None
    except (RowError, ValueError, OSError) as e:
        raise CanaryError(f"cannot tokenize the chosen samples from {cfg.dataset}: {e}", EXIT_USAGE) from None


def _forward_and_compare(
    backend: Backend, run: Run, samples: list[Sample], shards: dict[str, dict[str, torch.Tensor]], tolerance: float
) -> list[SampleCheck]:
    """One run (a rebuilt batch, or a sample alone) through the backend; its chosen samples compared."""
    rec = run.record
    try:
        with _cpu_threads(rec.threads if rec is not None and run.ids and _on_cpu(rec.device) else None):
            got = {r.sample_id: r for r in backend.extract(samples)}
    except Exception as e:  # the backend's own failure: no verdict on this node's values
        raise CanaryError(
            f"sample(s) {', '.join(map(repr, run.checks))}: the forward failed: {type(e).__name__}: {e}"
        ) from None
    by_id = {s.sample_id: s for s in samples}
    checks = []
    for sid in run.checks:
        sample, states = by_id[sid], got[sid]
        tensors = {"hidden_state": in_memory(states.hidden_state), "aux_hidden_state": in_memory(states.aux_hidden_state)}
        check = compare_sample(sid, shards[sid], sample.input_ids, sample.loss_mask, tensors, tolerance)
        check.mode, check.why_alone, check.rows = run.mode, run.why, len(samples)
        check.width = max(int(s.input_ids.numel()) for s in samples)
        if rec is not None:
            check.batch, check.batch_line = rec.batch, rec.line
        if run.changed:
            check.ok = False
            check.why = "; ".join(
                x for x in (
                    f"row(s) {', '.join(map(repr, run.changed))} of its batch tokenize to another length than when "
                    f"the batch ran (batches.jsonl line {rec.line if rec else '?'}): this node tokenizes differently",
                    check.why,
                ) if x
            )
        checks.append(check)
    return checks


def _on_cpu(device: str) -> bool:
    return device.startswith("cpu")


@contextlib.contextmanager
def _cpu_threads(threads: int | None) -> Iterator[None]:
    """torch's threads for a rebuilt batch that ran on a CPU (its line's), restored after."""
    if threads is None or threads == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _describe_log(log: BatchLogState) -> str:
    """The batch log in a few words, for the record."""
    if not log.present:
        return "absent (shards written before batch membership was recorded)"
    torn = f", {len(log.damaged)} torn or damaged line(s) skipped" if log.damaged else ""
    return f"{len(log.records)} batch line(s){torn}"


def _describe_runs(runs: list[Run], forwarded: int) -> str:
    """'2 original batch(es) rebuilt, 1 sample alone (why); 17 samples forwarded'."""
    rebuilt = sum(r.record is not None for r in runs)
    alone = [r for r in runs if r.record is None]
    parts = []
    if rebuilt:
        parts.append(f"{rebuilt} original batch(es) rebuilt")
    if alone:
        whys = sorted({r.why for r in alone})
        parts.append(f"{len(alone)} sample(s) alone ({'; '.join(whys)})")
    return f"{', '.join(parts)}; {forwarded} sample(s) forwarded"


def _conclude(result: CanaryResult) -> None:
    """passed or mismatch, and the message that says which samples, by how much and at what cost."""
    worst = result.max_rel_error
    n = len(result.samples)
    equal = sum(all(s.bit_equal.values()) and bool(s.bit_equal) for s in result.samples)
    rebuilt = [s for s in result.samples if s.mode == "batch"]
    alone = [s for s in result.samples if s.mode != "batch"]
    how = []
    if rebuilt:
        how.append(
            f"{len(rebuilt)} in their original batch (rebuilt: {result.rebuilt} batch(es), tolerance "
            f"{result.batch_tolerance:g})"
        )
    if alone:
        whys = "; ".join(sorted({s.why_alone for s in alone}))
        how.append(f"{len(alone)} alone (tolerance {result.fallback_tolerance:g}: {whys})")
    cost = f"{result.forwarded} sample(s) forwarded"
    if all(s.ok for s in result.samples):
        result.state = "passed"
        result.message = (
            f"{n} sample(s) re-extracted agree with their shards: {', '.join(how)}; max relative error "
            f"{worst:.3g}, {equal} of {n} bit-equal; {cost}"
        )
        return
    bad = [s for s in result.samples if not s.ok]
    result.state = "mismatch"
    result.message = (
        f"this node computes differently from its shards: {len(bad)} of {n} sample(s) differ "
        f"({', '.join(how)}): " + "; ".join(f"{s.sample_id}: {s.why}" for s in bad) + f"; {cost}"
    )
