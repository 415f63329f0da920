"""The batch log (extraction/runner/batchlog.py) and the canary's rebuild of a sample's original batch
(extraction/canary/rebuild.py), on a real extraction of a few tiny samples (hf backend, CPU): the runner
records every batch it ran (a resume's re-run batch with only what it wrote, a batch retried one by one
as samples alone); the canary re-runs those batches and gets the shards' bits back; a line that is not a
batch record is an error naming the file and the line; torn and damaged lines are skipped; a line that
does not describe a shard is not used (the sample alone, said); a row that tokenizes to another length
is a mismatch."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import test_canary
from hsx_run_helpers import make_cfg, one_thread, run  # noqa: F401 - one_thread: one torch thread here
from test_canary import canary_cli

from extraction.canary.check import run_canary
from extraction.canary.rebuild import plan_runs
from extraction.runner.batchlog import (
    BATCHES_NAME,
    BatchLog,
    BatchLogError,
    BatchLogState,
    batch_id,
    last_batches,
    read_batch_log,
)
from hsx.exitcodes import EXIT_CANARY_MISMATCH, EXIT_FAILED, EXIT_OK
from hsx.index import append_index, encode_index_line, read_index, tombstone_record

# test_canary's fixtures: the tiny extraction (once for this module) and a copy of it with its job config
extracted = test_canary.extracted
job = test_canary.job


def lines(out: Path) -> list[dict]:
    return [json.loads(line.rpartition(b"\t")[0]) for line in (out / BATCHES_NAME).read_bytes().splitlines()]


def test_the_runner_records_every_batch_it_ran(job) -> None:
    out = job["output"]
    recs = lines(out)
    index = read_index(str(out)).entries
    assert sorted(sid for r in recs for sid in r["ids"]) == sorted(index)  # each sample in one batch
    for r in recs:
        assert set(r) == {"v", "batch", "ids", "lens", "wrote", "device", "threads"}
        assert 1 <= len(r["ids"]) <= 4 and r["wrote"] == list(range(len(r["ids"])))  # a fresh run writes all
        rows = list(zip(r["lens"], r["ids"], strict=True))
        assert rows == sorted(rows)  # the plan's order: by length, then id
        assert r["batch"] == batch_id(r["ids"], r["lens"]) and r["device"] == "cpu" and r["threads"] >= 1
    state = read_batch_log(str(out))
    assert state.present and not state.damaged and [r.line for r in state.records] == list(range(1, len(recs) + 1))
    for sid, rec in last_batches(state.records).items():
        assert rec.lens[rec.row_of(sid)] == index[sid].num_tokens


def test_a_resume_records_the_rerun_batch_with_what_it_wrote(job, backend, capsys) -> None:
    out = job["output"]
    before = lines(out)
    redo = before[0]["ids"][1]
    append_index(str(out), [tombstone_record(redo, "redo")])
    assert run(job["cfg"], backend) == EXIT_OK
    after = lines(out)
    assert after[: len(before)] == before and len(after) == len(before) + 1
    assert {**after[-1], "wrote": [0, 1]} == {**before[0], "wrote": [0, 1]} and after[-1]["wrote"] == [1]
    assert last_batches(read_batch_log(str(out)).records)[redo].line == len(after)
    code, res = canary_cli(job["config"], capsys=capsys)
    assert (code, res["state"], res["bit_equal"]) == (EXIT_OK, "passed", 2), res


def test_a_batch_retried_one_by_one_records_its_samples_alone(job, backend, tmp_path) -> None:
    out = tmp_path / "one-by-one"
    cfg = make_cfg(job["model"], job["dataset"], out, buckets=2)
    backend.fail = lambda samples: len(samples) > 1  # every batch fails whole: each sample alone
    try:
        assert run(cfg, backend) == EXIT_OK
    finally:
        backend.fail = None
    recs = lines(out)
    assert len(recs) == len(read_index(str(out)).entries) and {len(r["ids"]) for r in recs} == {1}
    result = run_canary(cfg, 2, backend_factory=lambda _c, _i: backend)
    assert result.state == "passed" and result.forwarded == 2 and result.max_rel_error == 0
    assert {(s.mode, s.rows) for s in result.samples} == {("batch", 1)}


def _line(**change) -> dict:
    good = {"v": 1, "ids": ["a", "b"], "lens": [3, 5], "wrote": [0, 1], "device": "cpu", "threads": 2}
    rec = {**good, **change}
    rec.setdefault("batch", batch_id(rec["ids"], rec["lens"]) if isinstance(rec["ids"], list) else "0" * 16)
    return rec


@pytest.mark.parametrize(
    ("record", "says"),
    [
        ({"id": "x", "path": "shards/00/x.pt"}, "not a batch record"),
        (_line(v=2), "version 2"),
        (_line(ids=["a", "a"]), "names a sample twice"),
        (_line(lens=[3]), "lens is not 2 token counts"),
        (_line(lens=[3, 0]), "lens is not 2 token counts"),
        (_line(wrote=[2]), "wrote is not a list of rows 0..1"),
        (_line(threads=0), "threads is 0"),
        (_line(batch="0123456789abcdef"), "is not the id of its rows"),
        ([1, 2], "not a JSON object"),
    ],
)
def test_a_line_that_is_not_a_batch_record_is_an_error_naming_the_file_and_line(tmp_path, record, says) -> None:
    body = json.dumps(record, separators=(",", ":")).encode()
    (tmp_path / BATCHES_NAME).write_bytes(encode_index_line(_line()) + body + b"\t%08x\n" % zlib.crc32(body))
    with pytest.raises(BatchLogError) as e:
        read_batch_log(str(tmp_path))
    assert f"{tmp_path / BATCHES_NAME} line 2: " in str(e.value) and says in str(e.value), str(e.value)


def test_the_canary_refuses_a_forged_batch_log_naming_it(job, capsys) -> None:
    path = job["output"] / BATCHES_NAME
    with open(path, "ab") as f:
        f.write(encode_index_line(_line(batch="0123456789abcdef")))
    n = len(path.read_bytes().splitlines())
    code, res = canary_cli(job["config"], capsys=capsys)
    assert (code, res["state"], res["checked"]) == (EXIT_FAILED, "error", 0), res
    assert f"{path} line {n}: batch 0123456789abcdef is not the id of its rows" in res["message"]
    assert "move it aside" in res["message"]


def test_torn_and_damaged_lines_are_skipped(job, capsys) -> None:
    path = job["output"] / BATCHES_NAME
    data = path.read_bytes()
    damaged = encode_index_line(_line()).replace(b'"a"', b'"z"')  # its CRC no longer holds
    path.write_bytes(damaged + data + b'{"v":1,"ids":["tor')  # a crash's torn tail
    code, res = canary_cli(job["config"], capsys=capsys)
    assert (code, res["state"], res["bit_equal"]) == (EXIT_OK, "passed", 2), res
    assert "2 torn or damaged line(s) skipped" in res["batch_log"]
    # The runner ends a torn tail before it appends, so its next line stands alone.
    log = BatchLog(str(job["output"]), "cpu", print)
    log.record([("a", 3)], {"a"}, 1)
    log.close()
    state = read_batch_log(str(job["output"]))
    assert state.records[-1].ids == ("a",) and len(state.damaged) == 2


def test_a_line_that_does_not_describe_the_shard_is_not_used(job, capsys) -> None:
    out = str(job["output"])
    code, first = canary_cli(job["config"], capsys=capsys)
    sid = first["samples"][0]["id"]
    n = read_index(out).entries[sid].num_tokens
    with open(job["output"] / BATCHES_NAME, "ab") as f:  # a later line that "published" it at another length
        f.write(encode_index_line(_line(ids=[sid], lens=[n + 1], wrote=[0])))
    code, res = canary_cli(job["config"], capsys=capsys)
    assert (code, res["state"]) == (EXIT_OK, "passed"), res
    alone = next(s for s in res["samples"] if s["id"] == sid)
    assert alone["mode"] == "alone" and "does not describe its shard" in alone["why_alone"], alone
    assert f"says {n + 1} tokens" in alone["why_alone"] and alone["tolerance"] == 1e-4


def test_a_row_that_tokenizes_to_another_length_is_a_mismatch(job, capsys) -> None:
    out = str(job["output"])
    code, first = canary_cli(job["config"], capsys=capsys)
    sid = first["samples"][0]["id"]
    rec = last_batches(read_batch_log(out).records)[sid]
    other = next(i for i in rec.ids if i != sid)
    # recorded one token short: the job's tokenizer, cut at max(bound, that), gives another length
    lens = [n - (1 if i == other else 0) for i, n in zip(rec.ids, rec.lens, strict=True)]
    with open(job["output"] / BATCHES_NAME, "ab") as f:
        f.write(encode_index_line(_line(ids=list(rec.ids), lens=lens, wrote=[rec.row_of(sid)])))
    code, res = canary_cli(job["config"], capsys=capsys)
    assert (code, res["state"]) == (EXIT_CANARY_MISMATCH, "mismatch") and sid in res["mismatched"], res
    bad = next(s for s in res["samples"] if s["id"] == sid)
    assert f"row(s) {other!r} of its batch tokenize to another length" in bad["why"], bad


def test_the_sglang_backend_runs_each_sample_alone_and_says_why(job) -> None:
    out = str(job["output"])
    entries = list(read_index(out).entries.values())[:2]
    shards = {e.sample_id: {"input_ids": SimpleNamespace(numel=lambda e=e: e.num_tokens)} for e in entries}
    cfg = SimpleNamespace(backend="sglang", device="cpu")
    runs = plan_runs(cfg, read_batch_log(out), entries, shards)  # type: ignore[arg-type]
    assert [(r.mode, r.ids) for r in runs] == [("alone", [e.sample_id]) for e in entries]
    assert "server makes its own batches" in runs[0].why
    hf = plan_runs(SimpleNamespace(backend="hf", device="cuda"), read_batch_log(out), entries, shards)  # type: ignore[arg-type]
    assert {r.mode for r in hf} == {"alone"} and "ran on cpu" in hf[0].why and "this job runs on cuda" in hf[0].why


def test_a_batch_log_that_cannot_be_written_stops_recording_and_says_so(tmp_path) -> None:
    (tmp_path / "elsewhere").write_bytes(b"")
    os.symlink(tmp_path / "elsewhere", tmp_path / BATCHES_NAME)  # a link there is never followed
    said: list[str] = []
    log = BatchLog(str(tmp_path), "cpu", said.append)
    log.record([("a", 3)], {"a"}, 1)
    log.close()
    assert (tmp_path / "elsewhere").read_bytes() == b"" and len(said) == 1
    assert f"cannot write {tmp_path / BATCHES_NAME}" in said[0] and "alone" in said[0]
    assert BatchLogState(str(tmp_path), [], [], False).present is False
