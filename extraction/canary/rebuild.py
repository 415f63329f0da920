"""Which batch the canary runs each chosen sample in: its original batch rebuilt, or itself alone.

A state depends on the batch it was computed in (padding and shape pick other kernels: on an H100 a
bf16 sample alone differs from itself in its batch of 8 by up to 56% of the state's scale), so only
the original batch can be expected to give the shard's bits back.

Contract:
- `plan_runs(cfg, log, entries, shards)` -> the forwards to make, in order (`Run`s). A chosen sample
  is rebuilt in its original batch - the last line of OUTPUT/batches.jsonl that published it
  (extraction/runner/batchlog.py), its rows in their order, so the same padding and shape - when
  the job's backend is hf, the line ran on the job's device, and the line's token count for the
  sample equals its index entry's and its shard's. Otherwise it runs alone, and `Run.why` says why
  (no batch log: shards written before batch recording; no line for it; the sglang server batches
  on its own; another device; a line that does not describe its shard). Chosen samples of one
  batch share its Run: each batch is forwarded once.
- `tokenize_run(run, ...)`: the run's rows through the job's chat tokenizer, each cut at the larger
  of the run's token bound and its recorded (or, alone, its shard's) length. A row whose token count
  now differs from the record's is named in `Run.changed`: the chosen samples of that batch are a
  mismatch (this node tokenizes differently), never a pass at another shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from extraction.backends.base import Sample
from extraction.inputs.chat_tokenizer import ChatTokenizer
from extraction.inputs.config import ExtractConfig
from extraction.inputs.dataset import DatasetEntry, read_conversations
from extraction.runner.batchlog import BATCHES_NAME, BatchLogState, BatchRecord, last_batches
from hsx.index import IndexEntry

ALONE = "alone"
BATCH = "batch"


@dataclass
class Run:
    """One forward the canary makes: a rebuilt batch (`record`) or one sample alone (`why`)."""

    ids: list[str]  # rows in order
    checks: list[str]  # the chosen samples among them, compared with their shards
    record: BatchRecord | None = None
    why: str = ""  # alone: why not in its original batch
    changed: list[str] = field(default_factory=list)  # rows that tokenize to another length now

    @property
    def mode(self) -> str:
        return BATCH if self.record is not None else ALONE


def plan_runs(
    cfg: ExtractConfig, log: BatchLogState, entries: list[IndexEntry], shards: dict[str, dict[str, torch.Tensor]]
) -> list[Run]:
    """The forwards for the chosen `entries` (see the module's contract)."""
    by_sample = last_batches(log.records)
    runs: dict[str, Run] = {}
    out: list[Run] = []
    for e in entries:
        rec, why = _record_for(cfg, log, by_sample.get(e.sample_id), e, shards[e.sample_id])
        if rec is None:
            out.append(Run([e.sample_id], [e.sample_id], None, why))
            continue
        key = f"{rec.batch}:{rec.line}"
        if key in runs:
            runs[key].checks.append(e.sample_id)
            continue
        runs[key] = Run(list(rec.ids), [e.sample_id], rec)
        out.append(runs[key])
    return out


def _record_for(
    cfg: ExtractConfig, log: BatchLogState, rec: BatchRecord | None, entry: IndexEntry, shard: dict[str, torch.Tensor]
) -> tuple[BatchRecord | None, str]:
    """The sample's batch record, or None and why it runs alone."""
    if cfg.backend != "hf":
        return None, f"the {cfg.backend} server makes its own batches (none recorded to rebuild)"
    if not log.present:
        return None, f"no {BATCHES_NAME} in the output (shards written before batch membership was recorded)"
    if rec is None:
        return None, f"{BATCHES_NAME} has no line that published it (written before batch recording, or lost in a crash)"
    n = rec.lens[rec.row_of(entry.sample_id)]
    length = int(shard["input_ids"].numel())
    if n != entry.num_tokens or n != length:
        return None, (
            f"its batch record ({log.path} line {rec.line}) says {n} tokens, its index entry "
            f"{entry.num_tokens} and its shard {length}: the record does not describe its shard"
        )
    if rec.device != cfg.device:
        return None, f"its batch ran on {rec.device} ({log.path} line {rec.line}), this job runs on {cfg.device}"
    return rec, ""


def tokenize_run(
    run: Run,
    cfg: ExtractConfig,
    tokenizer: ChatTokenizer,
    rows: dict[str, DatasetEntry],
    shards: dict[str, dict[str, torch.Tensor]],
) -> list[Sample]:
    """The run's rows, tokenized in their order (see the module's contract); sets `run.changed`.
    Raises KeyError naming the rows the dataset does not hold, RowError/ValueError/OSError as the
    dataset reader does."""
    missing = [sid for sid in run.ids if sid not in rows]
    if missing:
        raise KeyError(missing)
    if run.record is not None:
        want = dict(zip(run.record.ids, run.record.lens, strict=True))
    else:
        want = {sid: int(shards[sid]["input_ids"].numel()) for sid in run.ids}
    bound = tokenizer.max_length or 0
    samples = [
        ChatTokenizer(tokenizer.tokenizer, max(bound, want[conv.sample_id])).encode(conv)
        for conv in read_conversations(cfg.dataset, [rows[s] for s in run.ids], cfg.max_row_bytes)
    ]
    if run.record is not None:
        run.changed = [s.sample_id for s in samples if int(s.input_ids.numel()) != want[s.sample_id]]
    return samples
