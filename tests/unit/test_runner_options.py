"""`hsx extract` on the tiny model: its options and the CLI - CPU threads beside the writers, shards of a
dataset, the tokenizer running ahead (bounded; in a child process), --limit, config file and CLI
precedence, the CLI end to end and its output's modes. Shared fixtures: hsx_run_helpers."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
import yaml
from hsx_run_helpers import (
    LAYERS,
    N,
    assert_complete,
    load_shards,
    make_cfg,
    one_thread,  # noqa: F401  (autouse)
    run,
)

import hsx.cores
from extraction.cli import main
from extraction.inputs.config import ConfigError, build_config
from extraction.inputs.dataset import scan_dataset
from extraction.runner import Runner
from extraction.runner.forward import forward_cpu_threads
from extraction.runner.plan import QUEUE_BATCHES, assigned_to
from extraction.runner.produce import TOKENIZE_AHEAD_BYTES, tokenize_ahead_batches
from extraction.shards.verify import verify_output
from extraction.testbed.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from hsx.index import load_index
from hsx.status import ERRORS_NAME, read_status


@pytest.mark.parametrize(
    ("cores", "writers", "threads"),
    [(1, 1, 1), (2, 1, 2), (4, 1, 4), (8, 2, 8), (12, 2, 9), (16, 2, 13), (64, 2, 61)],
)
def test_forward_cpu_threads(cores, writers, threads) -> None:
    assert forward_cpu_threads(cores, writers) == threads


def test_cpu_forward_threads_set_and_restored(
    tiny_model_dir, dataset, backend, tmp_path, monkeypatch
) -> None:
    """On a CPU device the forward runs on the runner's thread count (--cpu-threads, else
    OMP_NUM_THREADS's, else all cores but the pipeline's on a large host, at most the caller's),
    restored afterwards."""
    seen: list[int] = []
    inner = backend.extract
    backend.extract = lambda samples: seen.append(torch.get_num_threads()) or inner(samples)
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(hsx.cores, "usable_cores", lambda: 16)
    try:
        for out, kw, env, caller, want in (
            ("auto", {}, None, 16, 13),
            ("auto-fewer", {}, None, 1, 1),  # never more than the caller's
            ("given", {"cpu_threads": 3}, "5", 1, 3),
            ("omp", {}, "16", 16, 16),  # the formula would give 13
        ):
            if env is not None:
                monkeypatch.setenv("OMP_NUM_THREADS", env)
            torch.set_num_threads(caller)
            seen.clear()
            logs: list[str] = []
            cfg = make_cfg(tiny_model_dir, dataset, tmp_path / out, limit=4, **kw)
            assert run(cfg, backend, logs, writer_threads=2) == EXIT_OK
            assert seen and set(seen) == {want}, (out, seen)
            assert f"forward on {want} torch threads" in "\n".join(logs)
            assert torch.get_num_threads() == caller
    finally:
        torch.set_num_threads(before)


def test_shards_split_dataset_without_overlap(tiny_model_dir, dataset, backend, tmp_path, ids) -> None:
    got = []
    for i in range(3):
        out = tmp_path / f"node{i}"
        assert run(make_cfg(tiny_model_dir, dataset, out, shard_index=i, num_shards=3), backend) == EXIT_OK
        got.append(set(load_index(str(out))))
        assert got[-1] == {s for s in ids if assigned_to(s, i, 3)}
    assert set().union(*got) == ids and sum(map(len, got)) == len(ids)
    assert all(got)


def test_tokenizer_runs_ahead_while_the_model_loads(tiny_model_dir, dataset, backend, tmp_path, ids) -> None:
    """All 10 batches are tokenized during a slow model load, not only the forward queue's 4."""
    batches = N // 2
    assert tokenize_ahead_batches(2, 40) > batches > QUEUE_BATCHES
    seen: list[int] = []

    def slow_load(_cfg, _ids):
        deadline = time.monotonic() + 10
        while runner.batch_q.qsize() < batches + 1 and time.monotonic() < deadline:  # + the end mark
            time.sleep(0.01)
        seen.append(runner.batch_q.qsize())
        return backend

    out = tmp_path / "out"
    runner = Runner(
        make_cfg(tiny_model_dir, dataset, out, batch_size=2), backend_factory=slow_load, log=lambda _m: None
    )
    assert runner.run() == EXIT_OK
    assert seen == [batches + 1]
    assert_complete(out, ids)


def test_tokenize_ahead_is_bounded_by_bytes() -> None:
    assert tokenize_ahead_batches(16, 1024) == TOKENIZE_AHEAD_BYTES // (16 * 1024 * 16)
    assert tokenize_ahead_batches(16, None) == TOKENIZE_AHEAD_BYTES // (16 * 32768 * 16)
    assert tokenize_ahead_batches(4096, 1 << 20) == QUEUE_BATCHES


def test_limit(tiny_model_dir, dataset, backend, tmp_path) -> None:
    assert run(make_cfg(tiny_model_dir, dataset, tmp_path / "out", limit=5), backend) == EXIT_OK
    first5 = [e.sample_id for e in scan_dataset(dataset).entries[:5]]
    assert sorted(load_index(str(tmp_path / "out"))) == sorted(first5)
    assert read_status(str(tmp_path / "out"))["total"] == 5


def test_config_file_and_cli_precedence(tmp_path, tiny_model_dir, dataset) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_model_dir),
                "dataset": str(dataset),
                "output": "o",
                "batch-size": 3,
                "layers": [1, 3, 4],
                "reserve_bytes": "2G",
                "dtype": "fp16",
            }
        )
    )
    cfg = build_config({"config": str(conf), "batch_size": 5})
    assert (cfg.batch_size, cfg.layers, cfg.reserve_bytes, cfg.dtype) == (5, "1,3,4", 2 * 1024**3, "fp16")
    conf.write_text("model: m\nbogus: 1\n")
    with pytest.raises(ConfigError, match="unknown option 'bogus'"):
        build_config({"config": str(conf)})
    with pytest.raises(ConfigError, match="shard-index"):
        build_config({"model": "m", "dataset": "d", "output": "o", "shard_index": 3, "num_shards": 2})


def test_cli_end_to_end(tmp_path, tiny_model_dir, capsys) -> None:
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 4, seed=2)
    conf = tmp_path / "c.yaml"
    conf.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_model_dir),
                "dataset": str(ds),
                "layers": LAYERS,
                "dtype": "fp32",
                "max_length": 24,
                "progress": "off",
            }
        )
    )
    out = tmp_path / "out"
    assert main(["extract", "--config", str(conf), "--output", str(out)]) == 0
    assert len(load_index(str(out))) == 4
    # A --layers the model cannot capture (8 layers: canonical ids 1..7) is a usage error that says why.
    assert main(["extract", "--config", str(conf), "--output", str(out), "--layers", "1,3,8"]) == EXIT_USAGE
    assert "out of range for a 8-layer model" in capsys.readouterr().err


def test_cli_output_is_never_world_readable(tmp_path, tiny_model_dir) -> None:
    """input_ids reveal the dataset: a manual `hsx extract` under umask 022 (root's usual) writes
    nothing others can read; the unit's own UMask=0027 gives the same (#30 item 11)."""
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 3, seed=3)
    out = tmp_path / "out"
    argv = ["extract", "--model", str(tiny_model_dir), "--dataset", str(ds), "--output", str(out),
            "--layers", LAYERS, "--dtype", "fp32", "--max-length", "24", "--progress", "off"]
    old = os.umask(0o022)
    try:
        assert main(argv) == 0
        after = os.umask(0o022)
    finally:
        os.umask(old)
    assert after == 0o022, f"main() left the process's umask at {after:o}"  # it also runs in-process
    assert len(load_index(str(out))) == 3
    assert out.stat().st_mode & 0o007 == 0, oct(out.stat().st_mode)
    readable = [
        str(p.relative_to(out))
        for p in [out, *out.rglob("*")]
        if p.stat().st_mode & 0o004 and p.name != "metrics.prom"  # 0644 for node_exporter, inside a 0750 OUTPUT
    ]
    assert not readable, readable


def test_tokenizer_runs_in_a_child_process_same_bits_and_row_errors(
    tiny_model_dir, dataset, backend, tmp_path, ids, monkeypatch
) -> None:
    """The chat template is rendered in a forked process (its Python never holds this process's
    GIL); the shards are bit-identical to tokenizing on a thread, and a row the template cannot
    render is still logged with its line while the run goes on."""
    from extraction.inputs.chat_tokenizer import ChatTokenizer

    pids = tmp_path / "encode-pids"
    poison = sorted(ids)[3]
    real = ChatTokenizer.encode

    def encode(self, conv):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        if conv.sample_id == poison:
            raise ValueError("template cannot render this row")
        return real(self, conv)

    monkeypatch.setattr(ChatTokenizer, "encode", encode)
    outs = {}
    for mode in ("process", "thread"):
        pids.unlink(missing_ok=True)
        outs[mode] = tmp_path / mode
        cfg = make_cfg(tiny_model_dir, dataset, outs[mode])
        # a row that cannot be tokenized is a data error, as a malformed one
        assert run(cfg, backend, tokenizer_process=mode == "process") == EXIT_OK
        seen = {int(x) for x in pids.read_text().split()}
        assert (seen != {os.getpid()}) if mode == "process" else (seen == {os.getpid()}), (mode, seen)
        errors = [json.loads(x) for x in (outs[mode] / ERRORS_NAME).read_text().splitlines()]
        assert [(e["kind"], e.get("sample_id")) for e in errors] == [("row", poison)]
        assert "tokenization failed: template cannot render this row" in errors[0]["reason"]
        assert sorted(load_index(str(outs[mode]))) == sorted(ids - {poison})
        status = read_status(str(outs[mode]))
        assert status["row_errors"] == 1 and status["total"] == N - 1 == status["done"]
    got, want = load_shards(outs["process"]), load_shards(outs["thread"])
    assert sorted(got) == sorted(want) == sorted(ids - {poison})
    for sid, t in want.items():
        for key, value in t.items():
            assert torch.equal(got[sid][key], value), (sid, key)


def test_tokenizer_process_killed_fails_the_run_with_the_reason(
    tiny_model_dir, dataset, backend, tmp_path, ids, monkeypatch
) -> None:
    """The tokenizer process dies (OOM killer, kill -9): the run stops with a message saying so,
    exit 1; what was written is whole and indexed, and a rerun finishes the rest."""
    from extraction.inputs.chat_tokenizer import ChatTokenizer

    real = ChatTokenizer.encode
    count = [0]
    parent = os.getpid()

    def encode(self, conv):
        count[0] += 1
        if count[0] == 18 and os.getpid() != parent:  # in the second planning window
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, conv)

    monkeypatch.setattr(ChatTokenizer, "encode", encode)
    out, logs = tmp_path / "out", []
    assert run(make_cfg(tiny_model_dir, dataset, out, batch_size=1), backend, logs) == EXIT_FAILED
    assert any("the tokenizer process failed" in m and "killed by SIGKILL" in m for m in logs), logs
    status = read_status(str(out))
    assert status["state"] == "failed" and "tokenizer process" in status["message"]
    done = load_index(str(out))
    assert len(done) < N
    r = verify_output(str(out), "quick")
    assert r.exit_code == 0 and r.ok == len(done)
    monkeypatch.setattr(ChatTokenizer, "encode", real)
    assert run(make_cfg(tiny_model_dir, dataset, out, batch_size=1), backend) == EXIT_OK
    assert_complete(out, ids)
