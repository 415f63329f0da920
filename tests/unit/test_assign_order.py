"""Issue #39 review item 1: with --assign a node runs its samples bucket after bucket (by bucket,
then dataset position), so a node that stops part way has finished whole buckets (a takeover keeps
them) and has not started its highest ones (a rebalance can move them). The legacy
--shard-index/--num-shards split keeps the dataset order.
"""

from __future__ import annotations

from types import SimpleNamespace

from extraction.inputs.dataset import DatasetEntry
from extraction.runner.plan import assigned_to, node_samples
from hsx.buckets import bucket_of

BUCKETS = 8
ENTRIES = [DatasetEntry(sample_id=f"s{i}", line=i + 1, offset=100 * i) for i in range(200)]


def cfg(**kw: object) -> SimpleNamespace:
    """The fields of ExtractConfig node_samples reads."""
    return SimpleNamespace(**{"assign": None, "limit": None, "shard_index": 0, "num_shards": 1, **kw})


def test_assigned_samples_run_bucket_after_bucket_in_dataset_order_within_a_bucket() -> None:
    got = node_samples(ENTRIES, cfg(assign="1-2,5"), BUCKETS)
    keys = [(bucket_of(e.sample_id, BUCKETS), e.line) for e in got]
    assert keys == sorted(keys)
    assert {b for b, _ in keys} == {1, 2, 5}
    assert len(got) == sum(1 for e in ENTRIES if bucket_of(e.sample_id, BUCKETS) in {1, 2, 5})


def test_a_limit_takes_the_first_samples_in_that_order_so_whole_buckets_finish_first() -> None:
    bucket_1 = [e for e in ENTRIES if bucket_of(e.sample_id, BUCKETS) == 1]
    got = node_samples(ENTRIES, cfg(assign="1-2,5", limit=len(bucket_1)), BUCKETS)
    assert got == bucket_1


def test_the_legacy_shard_split_keeps_the_dataset_order() -> None:
    got = node_samples(ENTRIES, cfg(shard_index=1, num_shards=3, limit=20), BUCKETS)
    assert got == [e for e in ENTRIES if assigned_to(e.sample_id, 1, 3)][:20]
