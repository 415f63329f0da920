"""Which samples the canary re-extracts: a few finished ones, the same ones on every run.

Contract:
- Candidates are the index's live entries (later lines win, tombstones drop) that count as done by
  the rule verify and resume share (hsx.index.entry_problems: at the sample's own shard path, no
  path named twice) and carry run.json's fingerprint (or none: a line older than fingerprints).
- From the buckets this output has finished (hsx.bucketcount: every sample of the bucket indexed,
  by OUTPUT/buckets.json's totals), when it has one: a finished bucket's samples never change, so
  the choice is stable as the run goes on. Else (no buckets, no buckets.json, none finished yet)
  from every candidate.
- Ranked by `canary_rank` (sha256 of a fixed prefix and the id), the samples of `prefer` first
  (those whose original batch the canary can rebuild: a line of OUTPUT/batches.jsonl published
  them), the first `k`. The same output gives the same samples on every run and every host; the
  shard file's state plays no part in the choice, so a chosen shard that is missing or bad is an
  error the check reports, never a reason to pick another.
Stdlib and hsx only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from dataclasses import dataclass

from hsx.bucketcount import done_per_bucket, finished_buckets, read_bucket_totals
from hsx.buckets import bucket_of
from hsx.index import IndexEntry, IndexState, entry_problems

RANK_PREFIX = b"hsx-canary\0"


def canary_rank(sample_id: str) -> str:
    """The order candidates are taken in (stable across runs, hosts and Python versions)."""
    return hashlib.sha256(RANK_PREFIX + sample_id.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass
class Pick:
    """The chosen entries, and where they were chosen from (for the record)."""

    entries: list[IndexEntry]
    candidates: int  # entries the choice was made among
    source: str  # "finished buckets (N)" or "every indexed sample"


def pick_samples(
    output: str, state: IndexState, fingerprint: str | None, k: int, prefer: Collection[str] = ()
) -> Pick:
    """The first `k` candidates of `state` (index.jsonl read back) by canary_rank, `prefer`'s first
    (see the module's contract). `fingerprint`: run.json's (manifest_fingerprint)."""
    untrusted = entry_problems((sid, e.path) for sid, e in state.entries.items())
    good = {
        sid: e
        for sid, e in state.entries.items()
        if sid not in untrusted and (e.fingerprint is None or fingerprint is None or e.fingerprint == fingerprint)
    }
    source = "every indexed sample"
    totals = read_bucket_totals(output)
    if totals is not None and good:
        n = totals["buckets"]
        finished = finished_buckets(done_per_bucket(good, n), totals["totals"])
        in_finished = {sid: e for sid, e in good.items() if bucket_of(sid, n) in finished}
        if in_finished:
            good, source = in_finished, f"finished buckets ({len({bucket_of(s, n) for s in in_finished})})"
    ranked = sorted(good, key=lambda sid: (sid not in prefer, canary_rank(sid)))[: max(0, k)]
    return Pick([good[sid] for sid in ranked], len(good), source)
