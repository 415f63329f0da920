"""Per-bucket counts of a run: how many samples each bucket holds (written by the job) and how many
of them an output has done (read from its index). Stdlib only: the job and the extraction_status_info
module (on a node without the package) both use it.

Contract:
- `OUTPUT/buckets.json` (BUCKETS_NAME) is written by `hsx extract` when a run has buckets, each time
  it starts: `{"buckets": N, "assign": SPEC or null, "totals": [samples in bucket 0, ..., N-1]}`,
  counted over the whole dataset (every node scans all of it), replaced atomically.
- `read_bucket_totals(output)`: that file checked (N ints >= 0), or None when there is none or it is
  not one (a bucket with no known total is never counted finished: nothing is guessed).
- `done_per_bucket(ids, buckets)`: bucket -> samples done, for the ids an index holds.
- `finished_buckets(done, totals)`: the buckets whose samples are all done (a bucket of 0 samples
  is finished).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from typing import Any

from .buckets import bucket_of
from .fsutil import atomic_write_bytes, read_nofollow

BUCKETS_NAME = "buckets.json"
MAX_BYTES = 64 << 20  # 1M buckets of up to 11 digits


def write_bucket_totals(output: str, buckets: int, assign: str | None, totals: list[int]) -> None:
    """Replace OUTPUT/buckets.json atomically (no link followed)."""
    data = {"buckets": buckets, "assign": assign, "totals": totals}
    atomic_write_bytes(os.path.join(output, BUCKETS_NAME), (json.dumps(data) + "\n").encode("ascii"))


def count_totals(ids: Iterable[str], buckets: int) -> list[int]:
    """Samples per bucket (0..buckets-1) among `ids`."""
    totals = [0] * buckets
    for sample_id in ids:
        totals[bucket_of(sample_id, buckets)] += 1
    return totals


def read_bucket_totals(output: str) -> dict[str, Any] | None:
    """OUTPUT/buckets.json checked, or None (absent, a link, unreadable or not of this shape)."""
    try:
        data = json.loads(read_nofollow(os.path.join(output, BUCKETS_NAME), MAX_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    n, totals, assign = data.get("buckets"), data.get("totals"), data.get("assign")
    ok = (
        isinstance(n, int) and not isinstance(n, bool) and n > 0
        and isinstance(totals, list) and len(totals) == n
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in totals)
        and (assign is None or isinstance(assign, str))
    )
    return {"buckets": n, "assign": assign, "totals": totals} if ok else None


def done_per_bucket(ids: Iterable[str], buckets: int) -> dict[int, int]:
    """bucket -> how many of `ids` fall in it (only buckets with some)."""
    return dict(Counter(bucket_of(i, buckets) for i in ids))


def finished_buckets(done: dict[int, int], totals: list[int]) -> set[int]:
    """Buckets whose every sample is done."""
    return {b for b, total in enumerate(totals) if done.get(b, 0) >= total}
