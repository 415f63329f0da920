"""The tokenizer process gives the runner exactly the samples in-thread tokenization gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hsx_run_helpers import SharedBackend, assert_complete, load_shards, make_cfg, one_thread, run  # noqa: F401

from extraction.backends.hf import HFBackend
from extraction.config import ConfigError, build_config
from extraction.dataset import TOKENIZER_FILES, ChatTokenizer, load_tokenizer, scan_dataset
from extraction.runner import EXIT_OK, Runner
from extraction.tiny import write_tiny_dataset
from extraction.tokenize_worker import TokenizerProcess, TokenizerProcessError, tokenize_window


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_dataset(tmp_path_factory.mktemp("ds") / "d.jsonl", 40, seed=3)


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> SharedBackend:
    return SharedBackend(HFBackend(tiny_model_dir, [1, 3, 4], dtype="fp32"))


def test_the_child_gives_the_same_samples(tiny_model_dir, dataset):
    entries = scan_dataset(dataset).entries
    here = tokenize_window(ChatTokenizer(load_tokenizer(tiny_model_dir), 30), str(dataset), entries)
    proc = TokenizerProcess(str(tiny_model_dir), 30, str(dataset))
    try:
        assert proc.wait_ready(120)
        there = proc.tokenize(entries[:25]) + proc.tokenize(entries[25:])
    finally:
        proc.close()
    assert proc.proc.returncode == 0
    assert len(there) == len(here) == 40 and any(s.truncated for s in here)
    for a, b in zip(here, there, strict=True):
        assert (a.sample_id, a.truncated, a.meta) == (b.sample_id, b.truncated, b.meta)
        for x, y in ((a.input_ids, b.input_ids), (a.loss_mask, b.loss_mask)):
            assert x.dtype == y.dtype and torch.equal(x, y)


def test_a_child_that_cannot_load_the_tokenizer_says_why(tmp_path, dataset):
    proc = TokenizerProcess(str(tmp_path / "no-model"), None, str(dataset))
    try:
        with pytest.raises(TokenizerProcessError, match="cannot load the tokenizer"):
            proc.wait_ready(120)
    finally:
        proc.close()


def test_a_row_the_template_cannot_render_comes_back_as_a_row_error(tiny_model_dir, dataset, tmp_path):
    # A tokenizer whose template refuses a row that the dataset scan accepts.
    model = tmp_path / "model"
    model.mkdir()
    for name in TOKENIZER_FILES:
        if (tiny_model_dir / name).exists():
            shutil.copy(tiny_model_dir / name, model / name)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    refuse = "{% for m in messages %}{% if 'boom' in m['content'] %}{{ raise_exception('boom row') }}{% endif %}{% endfor %}"
    cfg["chat_template"] = refuse + cfg["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    ds = tmp_path / "d.jsonl"
    rows = dataset.read_text().splitlines()[:3]
    ds.write_text(
        "\n".join(
            [
                rows[0],
                '{"id": "b", "messages": [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "ok"}]}',
                *rows[1:],
            ]
        )
        + "\n"
    )
    entries = scan_dataset(ds).entries
    here = tokenize_window(ChatTokenizer(load_tokenizer(model)), str(ds), entries)
    proc = TokenizerProcess(str(model), None, str(ds))
    try:
        assert proc.wait_ready(120)
        there = proc.tokenize(entries)
    finally:
        proc.close()
    assert [type(x).__name__ for x in here] == ["Sample", "RowError", "Sample", "Sample"]
    assert [type(x) for x in there] == [type(x) for x in here]
    assert (there[1].line, there[1].sample_id, there[1].reason) == (here[1].line, "b", here[1].reason)
    assert "boom row" in there[1].reason


def test_runner_through_the_child_writes_the_same_shards(
    tiny_model_dir, dataset, backend, tmp_path, monkeypatch
):
    ids = {e.sample_id for e in scan_dataset(dataset).entries}
    ref = tmp_path / "ref"
    assert run(make_cfg(tiny_model_dir, dataset, ref, tokenizer_process="off"), backend) == EXIT_OK
    out = tmp_path / "out"
    monkeypatch.setattr(TokenizerProcess, "ready", lambda self: self.wait_ready(120))
    runner = Runner(
        make_cfg(tiny_model_dir, dataset, out, tokenizer_process="on"),
        log=lambda m: None,
        backend_factory=lambda _c, _i: backend,
    )
    assert runner.run() == EXIT_OK
    assert runner.timings["windows_by_tokenizer_process"] >= 1 and runner.tokenizer_proc is None
    assert_complete(out, ids)
    got, want = load_shards(out), load_shards(ref)
    assert got.keys() == want.keys()
    for sid, tensors in want.items():
        for key, value in tensors.items():
            assert torch.equal(got[sid][key], value), (sid, key)


def test_a_child_that_dies_mid_run_is_replaced_by_this_process(
    tiny_model_dir, dataset, backend, tmp_path, monkeypatch
):
    ids = {e.sample_id for e in scan_dataset(dataset).entries}
    real_tokenize = TokenizerProcess.tokenize
    monkeypatch.setattr(TokenizerProcess, "ready", lambda self: self.wait_ready(120))

    def killed(self, entries):
        self.proc.kill()
        self.proc.wait()
        return real_tokenize(self, entries)

    monkeypatch.setattr(TokenizerProcess, "tokenize", killed)
    logs: list[str] = []
    out = tmp_path / "out"
    assert (
        run(make_cfg(tiny_model_dir, dataset, out, tokenizer_process="on", batch_size=1), backend, logs)
        == EXIT_OK
    )
    assert any("tokenizer process failed" in m for m in logs), logs
    assert_complete(out, ids)


def test_tokenizer_process_option_is_checked(tiny_model_dir, dataset, tmp_path):
    with pytest.raises(ConfigError, match="--tokenizer-process must be auto, on or off"):
        build_config({"model": "m", "dataset": "d", "output": "o", "tokenizer_process": "maybe"})
