"""Plan: which samples this node runs, and the batches they run in.

Contract:
- `assigned_to`: node i of n runs a sample iff a hash of its stable id says so (the legacy
  --shard-index/--num-shards split); with --assign a node runs the samples whose bucket
  (hsx.buckets: the same id hash, modulo run.json's bucket count) it is assigned. No
  coordination, the same answer whatever the dataset's order. `node_samples` is this node's
  entries, at most --limit of them (the first in this order): with --assign ordered by (bucket,
  dataset position), so its buckets finish one after another (a node that stops part way has
  whole buckets finished, which a takeover leaves with it, and its highest buckets unstarted,
  which a rebalance can move); with --shard-index/--num-shards in dataset order, as before.
- `plan_windows` cuts them into fixed windows of WINDOW_BATCHES batches' worth, in that
  order; `batches_of_window` sorts a window's samples by (length, id) and cuts its batches (little
  padding, a fixed plan).
- The plan depends on the node's whole sample list only, never on what is done: a resume re-runs
  a planned batch whole even when some of its samples are done (their results are dropped),
  because padding and batch shape change float32 results in the last bits (on the tiny model: up
  to 2e-8 between a sample alone and in a batch). So a resumed run writes bit-identical tensors
  to an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from extraction.backends.base import Sample
from extraction.inputs.chat_tokenizer import ChatTokenizer
from extraction.inputs.config import ExtractConfig
from extraction.inputs.dataset import DatasetEntry, read_conversations
from hsx.bucketcount import BUCKETS_NAME, count_totals, write_bucket_totals
from hsx.buckets import bucket_of, id_hash, parse_assign

WINDOW_BATCHES = 16  # a planning window holds this many batches' worth of samples
# Batches buffered between the stages: forward -> publisher, and at least this many tokenized ahead.
QUEUE_BATCHES = 4


def assigned_to(sample_id: str, shard_index: int, num_shards: int) -> bool:
    """Node assignment by a hash of the stable id (hsx.buckets.id_hash, total): no coordination,
    stable under reordering."""
    if num_shards == 1:
        return True
    return id_hash(sample_id) % num_shards == shard_index


def node_samples(entries: list[DatasetEntry], cfg: ExtractConfig, buckets: int | None = None) -> list[DatasetEntry]:
    """This node's entries, at most --limit: those in the buckets of --assign (out of `buckets`,
    run.json's count) by (bucket, dataset position), else those of --shard-index of --num-shards in
    dataset order."""
    if cfg.assign is not None:
        if buckets is None:
            raise ValueError("--assign needs the run's bucket count")
        mine = parse_assign(cfg.assign, buckets)
        keyed = [(bucket_of(e.sample_id, buckets), i, e) for i, e in enumerate(entries)]
        assigned = [e for b, _, e in sorted(k for k in keyed if k[0] in mine)]
    else:
        assigned = [e for e in entries if assigned_to(e.sample_id, cfg.shard_index, cfg.num_shards)]
    return assigned if cfg.limit is None else assigned[: cfg.limit]


def record_bucket_totals(
    output: str, buckets: int, assign: str | None, entries: list[DatasetEntry], log: Callable[[str], None]
) -> None:
    """OUTPUT/buckets.json (hsx.bucketcount): the samples of every bucket in the whole dataset and
    this node's --assign, read by extraction_status_info for the fleet's view (a bucket is finished on a
    node when its index holds all of them). A write that fails is logged; the run goes on."""
    try:
        write_bucket_totals(output, buckets, assign, count_totals((e.sample_id for e in entries), buckets))
    except OSError as e:
        log(f"cannot write {output}/{BUCKETS_NAME} (the fleet's per-bucket view): {e.strerror or e}")


def plan_windows(entries: list[DatasetEntry], batch_size: int) -> list[list[DatasetEntry]]:
    """Fixed windows of `entries` in their order (node_samples'); batches are cut inside a window by length."""
    size = batch_size * WINDOW_BATCHES
    return [entries[i : i + size] for i in range(0, len(entries), size)]


def batches_of_window(samples: list[Sample], batch_size: int) -> list[list[Sample]]:
    """Sort a window's samples by length (ties by id) and cut batches: little padding, fixed plan."""
    ordered = sorted(samples, key=lambda s: (int(s.input_ids.numel()), s.sample_id))
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


def iter_batches_for_bench(
    cfg: ExtractConfig, entries: list[DatasetEntry], tokenizer: ChatTokenizer
) -> Iterator[list[Sample]]:
    """The runner's own batch plan over `entries`, tokenized on the calling thread: what the
    benchmarks run a bare forward loop over, to compare it with the runner."""
    for window in plan_windows(entries, cfg.batch_size):
        samples = [tokenizer.encode(c) for c in read_conversations(cfg.dataset, window, cfg.max_row_bytes)]
        yield from batches_of_window(samples, cfg.batch_size)
