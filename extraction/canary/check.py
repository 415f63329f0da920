"""The canary check: re-extract a few finished samples as the job would, compare them with their shards.

Contract (`run_canary(cfg, k, tolerance)` -> CanaryResult, extraction/canary/result.py):
- Nothing to compare (OUTPUT has no run.json, or its index no live entry): `skipped`, at once,
  before the model or the dataset is read.
- The job's own pieces, so the canary computes as the job does: the config (`cfg`, the job's
  config file), the inputs and run.json's manifest (runner/resume.py load_inputs: model, layers,
  dataset scan, tokenizer, token bound, buckets), the backend (runner/forward.py make_backend and
  check_backend: hf in process on cfg.device, or the job's SGLang server), torch's CPU threads
  (runner/forward.py forward_threads). Each chosen sample is tokenized with the job's chat
  tokenizer, cut at the larger of the run's token bound and the shard's length (a sample done
  before a resume tightened the bound was cut at the old one), and run ALONE (a batch of one: its
  original batch's neighbours are not reconstructed; the tolerance covers the difference).
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

import os
import time
from collections.abc import Callable

import torch

from extraction.backends.base import Backend, Sample
from extraction.canary.compare import SampleCheck, compare_sample
from extraction.canary.pick import pick_samples
from extraction.canary.result import CanaryResult
from extraction.canary.settings import DEFAULT_SAMPLES, tolerance_for
from extraction.inputs.chat_tokenizer import ChatTokenizer
from extraction.inputs.config import ExtractConfig
from extraction.inputs.dataset import RowError, read_conversations
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
    backend_factory: Callable[[ExtractConfig, list[int]], Backend] = make_backend,
    log: Callable[[str], None] | None = None,
) -> CanaryResult:
    """The canary on `cfg`'s output (see the module's contract); never raises for a bad input."""
    if k < 1:
        raise ValueError(f"the canary needs at least one sample, got {k}")
    t0 = time.monotonic()
    device = cfg.device if cfg.backend == "hf" else cfg.server_url
    result = CanaryResult("error", "", str(cfg.output), requested=k, backend=cfg.backend, device=device)
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
    pick = pick_samples(output, state, fingerprint, k)
    result.source, result.candidates = pick.source, pick.candidates
    if not pick.entries:
        raise CanaryError(
            f"{output}: none of its {len(state.entries)} index entries can count as done (another run's "
            "fingerprint, or not at the sample's own shard path): verify it (hsx verify) before resuming"
        )
    inputs = _inputs(cfg, on_disk, fingerprint)
    result.dtype = inputs.manifest.dtype
    result.tolerance = tolerance if tolerance is not None else tolerance_for(inputs.manifest.dtype)
    shards = {e.sample_id: _load_shard(output, e, on_disk) for e in pick.entries}
    samples = _tokenize(cfg, inputs, pick.entries, shards)
    log(f"re-extracting {len(samples)} sample(s) from {pick.source} ({pick.candidates} candidates): "
        f"{', '.join(s.sample_id for s in samples)}")
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
            for sample in samples:
                result.samples.append(_forward_and_compare(backend, sample, shards[sample.sample_id], result.tolerance))
        result.forward_s = time.monotonic() - t2
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


def _tokenize(
    cfg: ExtractConfig, inputs: RunInputs, entries: list[IndexEntry], shards: dict[str, dict[str, torch.Tensor]]
) -> list[Sample]:
    """The chosen samples through the job's chat tokenizer (see the module's contract)."""
    rows = {e.sample_id: e for e in inputs.scan.entries}
    missing = [e.sample_id for e in entries if e.sample_id not in rows]
    if missing:
        raise CanaryError(
            f"sample(s) {', '.join(map(repr, missing))} are indexed in {cfg.output} but not in the dataset "
            f"{cfg.dataset}: the job's dataset is not the one the run was made from",
            EXIT_USAGE,
        )
    bound = inputs.tokenizer.max_length or 0
    samples = []
    try:
        for conv in read_conversations(cfg.dataset, [rows[e.sample_id] for e in entries], cfg.max_row_bytes):
            length = int(shards[conv.sample_id]["input_ids"].numel())
            tokenizer = ChatTokenizer(inputs.tokenizer.tokenizer, max(bound, length))
            samples.append(tokenizer.encode(conv))
    except (RowError, ValueError, OSError) as e:
        raise CanaryError(f"cannot tokenize the chosen samples from {cfg.dataset}: {e}", EXIT_USAGE) from None
    return samples


def _forward_and_compare(
    backend: Backend, sample: Sample, shard: dict[str, torch.Tensor], tolerance: float
) -> SampleCheck:
    """One sample alone through the backend, then compared with its shard."""
    try:
        (got,) = backend.extract([sample])
    except Exception as e:  # the backend's own failure: no verdict on this node's values
        raise CanaryError(f"sample {sample.sample_id!r}: the forward failed: {type(e).__name__}: {e}") from None
    states = {"hidden_state": in_memory(got.hidden_state), "aux_hidden_state": in_memory(got.aux_hidden_state)}
    return compare_sample(sample.sample_id, shard, sample.input_ids, sample.loss_mask, states, tolerance)


def _conclude(result: CanaryResult) -> None:
    """passed or mismatch, and the message that says which samples and by how much."""
    worst = result.max_rel_error
    n = len(result.samples)
    equal = sum(all(s.bit_equal.values()) and bool(s.bit_equal) for s in result.samples)
    if all(s.ok for s in result.samples):
        result.state = "passed"
        result.message = (
            f"{n} sample(s) re-extracted agree with their shards: max relative error {worst:.3g} "
            f"(tolerance {result.tolerance:g}), {equal} of {n} bit-equal"
        )
        return
    bad = [s for s in result.samples if not s.ok]
    result.state = "mismatch"
    result.message = (
        f"this node computes differently from its shards: {len(bad)} of {n} sample(s) differ "
        f"(tolerance {result.tolerance:g}): "
        + "; ".join(f"{s.sample_id}: {s.why}" for s in bad)
    )
