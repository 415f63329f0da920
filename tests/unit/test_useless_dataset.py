"""A dataset with no usable row fails the run (issue #38, item 2 of the user's list).

Before: a JSONL entirely in another shape (alpaca instruction/output) gave done 0/0, exit 0,
state done, and `hsx status` showed `errors 0`. Now the run fails naming the expected shapes and
the first bad line, `hsx status` shows the skipped rows, and the same command resumes the same
output once the dataset is fixed (rows that were errors are not results).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hsx_run_helpers import SharedBackend, make_cfg, run
from shard_helpers import make_run, manifest

from extraction.backends.hf import HFBackend
from extraction.inputs.dataset import ROW_SHAPES
from extraction.shards import ManifestMismatchError, ShardWriter
from extraction.testbed.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_FAILED, EXIT_OK
from hsx.index import load_index
from hsx.layout import MANIFEST_NAME
from hsx.status import describe, read_status, summarize

ALPACA = [{"instruction": f"say {i}", "input": "", "output": f"{i}"} for i in range(3)]


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> SharedBackend:
    return SharedBackend(HFBackend(tiny_model_dir, [1, 3, 4], dtype="fp32"))


def test_no_valid_row_fails_naming_the_shapes_and_the_first_bad_line(tiny_model_dir, backend, tmp_path):
    ds = tmp_path / "alpaca.jsonl"
    ds.write_text("\n".join(json.dumps(r) for r in ALPACA) + "\n")
    out = tmp_path / "out"
    logs: list[str] = []
    assert run(make_cfg(tiny_model_dir, ds, out), backend, logs) == EXIT_FAILED
    status = read_status(str(out))
    assert status["state"] == "failed" and status["row_errors"] == 3
    msg = status["message"]
    assert all(shape in msg for shape in ROW_SHAPES)
    assert f"{ds} line 1: row has neither" in msg
    assert "fix the dataset and run the same command again" in msg
    assert msg in logs
    assert "skipped rows 3" in describe(dict(status, pid_alive=False))

    # fixed: the same command resumes the same output; no row error of before is a result
    write_tiny_dataset(ds, 4, seed=3)
    assert run(make_cfg(tiny_model_dir, ds, out), backend) == EXIT_OK
    status = read_status(str(out))
    assert (status["state"], status["done"], status["total"], status["row_errors"]) == ("done", 4, 4, 0)
    assert len(load_index(str(out))) == 4


def test_status_sums_skipped_rows_over_outputs():
    assert summarize([{"row_errors": 2}, {"row_errors": 3}])["row_errors"] == 5


def test_a_changed_dataset_is_taken_while_the_output_holds_no_sample(tmp_path):
    ShardWriter(tmp_path, manifest(dataset_hash="before")).close()
    ShardWriter(tmp_path, manifest(dataset_hash="fixed")).close()
    assert json.loads((tmp_path / MANIFEST_NAME).read_text())["dataset_hash"] == "fixed"


def test_a_changed_dataset_with_samples_done_is_refused_saying_how(tmp_path):
    make_run(tmp_path, n=2)
    with pytest.raises(ManifestMismatchError) as e:
        ShardWriter(tmp_path, manifest(dataset_hash="fixed"))
    msg = str(e.value)
    assert "dataset_hash" in msg and "2 samples" in msg and "another --output" in msg
    assert json.loads((tmp_path / MANIFEST_NAME).read_text())["dataset_hash"] == "d"


def test_the_shapes_are_named_when_the_first_bad_row_is_of_another_kind(tiny_model_dir, backend, tmp_path):
    ds = tmp_path / "broken.jsonl"
    ds.write_text('{oops\n{"messages": []}\n')
    out = tmp_path / "out"
    assert run(make_cfg(tiny_model_dir, ds, out), backend) == EXIT_FAILED
    msg = read_status(str(out))["message"]
    assert f"{ds} line 1: invalid JSON" in msg and f"a row must be a JSON object with {' or '.join(ROW_SHAPES)}" in msg


def test_an_empty_dataset_fails_on_one_node_and_is_no_failure_for_a_node_given_nothing(
    tiny_model_dir, backend, tmp_path
):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert run(make_cfg(tiny_model_dir, empty, tmp_path / "one"), backend) == EXIT_FAILED
    msg = read_status(str(tmp_path / "one"))["message"]
    assert msg.startswith(f"no rows in {empty}: the file holds none; a row must be a JSON object with")
    one_row = write_tiny_dataset(tmp_path / "one.jsonl", 1, seed=5)
    for index in range(2):  # one of the two nodes gets the only row, the other none: both done
        out = tmp_path / f"node{index}"
        assert run(make_cfg(tiny_model_dir, one_row, out, shard_index=index, num_shards=2), backend) == EXIT_OK
        assert read_status(str(out))["state"] == "done"
