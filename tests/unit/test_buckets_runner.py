"""Issue #39 item 1: a run's samples in fixed buckets; a node runs the buckets it is assigned.

The bucket count is fixed when the run is made (run.json, and its fingerprint); the assignment is
not (a resume may run other buckets: a takeover), and status.json says the current one. Outputs
made before buckets (--shard-index/--num-shards) resume as they were made.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hsx_run_helpers import make_cfg, run

from extraction.inputs.config import ConfigError
from extraction.runner import resume as resume_mod
from extraction.runner.plan import assigned_to
from extraction.testbed.tiny import write_tiny_dataset
from hsx.bucketcount import count_totals, read_bucket_totals
from hsx.buckets import bucket_of
from hsx.exitcodes import EXIT_OK, EXIT_USAGE
from hsx.index import load_index
from hsx.layout import MANIFEST_NAME
from hsx.manifest import manifest_fingerprint
from hsx.status import read_status

N = 12
BUCKETS = 4


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This module's own dataset (seed 11 fills every bucket); conftest's `ids` and `backend` use it."""
    return write_tiny_dataset(tmp_path_factory.mktemp("ds") / "d.jsonl", N, seed=11)


def in_buckets(ids: set[str], buckets: set[int]) -> set[str]:
    return {i for i in ids if bucket_of(i, BUCKETS) in buckets}


def test_two_nodes_with_complementary_assignments_extract_the_dataset_exactly_once(
    tiny_model_dir, dataset, backend, tmp_path, ids
) -> None:
    assert in_buckets(ids, {0, 1}) and in_buckets(ids, {2, 3})  # the tiny dataset fills both halves
    got = {}
    for node, spec in (("a", "0-1"), ("b", "2,3")):
        out = tmp_path / node
        assert run(make_cfg(tiny_model_dir, dataset, out, buckets=BUCKETS, assign=spec), backend) == EXIT_OK
        got[node] = set(load_index(str(out)))
        assert json.loads((out / MANIFEST_NAME).read_text())["buckets"] == BUCKETS
        status = read_status(str(out))
        assert (status["buckets"], status["assign"], status["total"]) == (BUCKETS, spec, len(got[node]))
        # The fleet's per-bucket view (extraction_status): every bucket's samples, over the whole dataset.
        totals = read_bucket_totals(str(out))
        assert totals == {"buckets": BUCKETS, "assign": spec, "totals": count_totals(ids, BUCKETS)}
        assert sum(totals["totals"]) == len(ids)
    assert got["a"] == in_buckets(ids, {0, 1}) and got["b"] == in_buckets(ids, {2, 3})
    assert got["a"] | got["b"] == ids and not got["a"] & got["b"]


def test_a_resume_may_run_another_assignment_and_keeps_what_is_done(
    tiny_model_dir, dataset, backend, tmp_path, ids
) -> None:
    out = tmp_path / "out"
    assert run(make_cfg(tiny_model_dir, dataset, out, buckets=BUCKETS, assign="0-1"), backend) == EXIT_OK
    first = set(load_index(str(out)))
    assert first == in_buckets(ids, {0, 1}) and first != ids
    logs: list[str] = []
    # A takeover: buckets 2-3 added; the bucket count comes from run.json (no --buckets given).
    assert run(make_cfg(tiny_model_dir, dataset, out, assign="0-3"), backend, logs) == EXIT_OK
    assert set(load_index(str(out))) == ids
    assert any(f"resume: {len(first)} sample(s) already done" in m for m in logs), logs
    assert read_status(str(out))["assign"] == "0-3"
    assert read_bucket_totals(str(out))["assign"] == "0-3"  # rewritten at each start


def test_the_bucket_count_is_fixed_when_the_run_is_made(tiny_model_dir, dataset, backend, tmp_path) -> None:
    out = tmp_path / "out"
    assert run(make_cfg(tiny_model_dir, dataset, out, buckets=BUCKETS, assign="0"), backend) == EXIT_OK
    logs: list[str] = []
    assert run(make_cfg(tiny_model_dir, dataset, out, buckets=8, assign="0"), backend, logs) == EXIT_USAGE
    assert any(f"{out} holds a run of {BUCKETS} buckets" in m and "drop --buckets" in m for m in logs), logs
    assert run(make_cfg(tiny_model_dir, dataset, out, assign="0-4"), backend, logs) == EXIT_USAGE
    assert any("bucket 4 is outside 0-3 (the run has 4 buckets)" in m for m in logs), logs


def test_an_output_made_with_shard_index_resumes_as_it_was_made(
    tiny_model_dir, dataset, backend, tmp_path, ids, monkeypatch
) -> None:
    """A run.json from before buckets (none recorded): --shard-index/--num-shards resume it with its
    fingerprint unchanged; --assign is refused, saying what to do."""
    out = tmp_path / "out"
    with monkeypatch.context() as m:  # what the code before buckets wrote: no bucket count
        m.setattr(resume_mod, "run_buckets", lambda cfg: None)
        assert run(make_cfg(tiny_model_dir, dataset, out, shard_index=1, num_shards=2), backend) == EXIT_OK
    data = json.loads((out / MANIFEST_NAME).read_text())
    del data["buckets"]
    (out / MANIFEST_NAME).write_text(json.dumps(data))
    fp = manifest_fingerprint(data)
    mine = {i for i in ids if assigned_to(i, 1, 2)}
    assert set(load_index(str(out))) == mine
    logs: list[str] = []
    assert run(make_cfg(tiny_model_dir, dataset, out, shard_index=1, num_shards=2), backend, logs) == EXIT_OK
    assert any(f"already complete: {len(mine)}/{len(mine)}" in m for m in logs), logs
    assert {e.fingerprint for e in load_index(str(out)).values()} == {fp}
    assert run(make_cfg(tiny_model_dir, dataset, out, assign="0-1023"), backend, logs) == EXIT_USAGE
    assert any("was made before buckets" in m and "--shard-index/--num-shards" in m for m in logs), logs


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"assign": "0-3,"}, "--assign: assignment '0-3,': an empty part"),
        ({"assign": "5-2"}, "range '5-2' runs backwards"),
        ({"assign": "0-3,2"}, "bucket 2 is listed twice"),
        ({"assign": "a-b"}, "'a' is not a bucket number"),
        ({"assign": "0-8", "buckets": 8}, "bucket 8 is outside 0-7"),
        ({"buckets": 0}, "--buckets: the bucket count must be an integer in 1..1048576, got 0"),
        ({"assign": "0", "num_shards": 2}, "--assign and --num-shards are two ways to split"),
    ],
)
def test_a_bad_split_is_refused_before_anything_runs(tiny_model_dir, dataset, tmp_path, kw, says) -> None:
    with pytest.raises(ConfigError, match=None) as e:
        make_cfg(tiny_model_dir, dataset, tmp_path / "out", **kw)
    assert says in str(e.value)
    assert not (tmp_path / "out").exists()
