"""`hsx extract`'s bounds on a sample: rows in bytes, tokens (the model's context by default, a
tighter --max-length on a resume), and a forward out of memory failing that sample only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hsx_run_helpers import (
    SharedBackend,
    load_shards,
    make_cfg,
    one_thread,  # noqa: F401  (autouse)
    run,
)

from extraction.backends.hf import HFBackend
from extraction.inputs.dataset import scan_dataset
from extraction.testbed.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from hsx.index import load_index
from hsx.layout import MANIFEST_NAME
from hsx.status import ERRORS_NAME

N = 12
CONTEXT = 32  # the copied model's max_position_embeddings


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_dataset(tmp_path_factory.mktemp("ds") / "d.jsonl", N, seed=7)


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> SharedBackend:
    return SharedBackend(HFBackend(tiny_model_dir, [1, 3, 4], dtype="fp32"))


@pytest.fixture(scope="module")
def short_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a context of CONTEXT tokens (config.json's max_position_embeddings)."""
    out = tmp_path_factory.mktemp("short") / "model"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (out / "config.json").write_text(json.dumps(config))
    return out


def _errors(out: Path) -> list[dict]:
    path = out / ERRORS_NAME
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_a_row_over_max_row_bytes_is_a_row_error_and_the_run_goes_on(tiny_model_dir, backend, tmp_path) -> None:
    good = write_tiny_dataset(tmp_path / "g.jsonl", 3, seed=1).read_text().splitlines()
    big = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a " * 2000}]})
    ds = tmp_path / "d.jsonl"
    ds.write_text("\n".join([good[0], big, *good[1:]]) + "\n")
    out = tmp_path / "out"
    assert run(make_cfg(tiny_model_dir, ds, out, max_row_bytes="2K"), backend) == EXIT_OK
    (err,) = _errors(out)
    assert (err["kind"], err["line"]) == ("row", 2) and "over the 2048-byte bound (--max-row-bytes)" in err["reason"]
    assert len(load_index(str(out))) == 3


def test_the_models_context_bounds_every_sample_without_max_length(short_model, dataset, backend, tmp_path) -> None:
    out = tmp_path / "out"
    assert run(make_cfg(short_model, dataset, out, max_length=None), backend) == EXIT_OK
    shards = load_shards(out)
    assert len(shards) == N and max(len(t["input_ids"]) for t in shards.values()) == CONTEXT
    cut = {sid for sid, t in shards.items() if len(t["input_ids"]) == CONTEXT}
    notes = [e for e in _errors(out) if e["kind"] == "truncated"]
    assert {e["sample_id"] for e in notes} == cut and cut
    assert all(f"cut to the model's context of {CONTEXT} tokens" in e["reason"] for e in notes), notes
    extra = json.loads((out / MANIFEST_NAME).read_text())["extra"]
    assert (extra["max_length"], extra["token_bound"]) == (None, CONTEXT)


def test_a_tighter_bound_resumes_a_looser_one_is_refused(short_model, dataset, backend, tmp_path) -> None:
    out = tmp_path / "out"
    assert run(make_cfg(short_model, dataset, out, max_length=None, limit=4), backend) == EXIT_OK
    before = {sid: len(t["input_ids"]) for sid, t in load_shards(out).items()}
    assert len(before) == 4
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    del manifest["extra"]["token_bound"]  # as a run before the default bound wrote it: no bound
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    logs: list[str] = []
    assert run(make_cfg(short_model, dataset, out, max_length=20), backend, logs) == EXIT_OK
    after = {sid: len(t["input_ids"]) for sid, t in load_shards(out).items()}
    assert len(after) == N and all(after[sid] == n for sid, n in before.items())  # done ones kept
    assert all(n <= 20 for sid, n in after.items() if sid not in before)
    extra = json.loads((out / MANIFEST_NAME).read_text())["extra"]
    assert extra["token_bound"] == 20 and [(h["from"], h["to"]) for h in extra["bound_history"]] == [(None, 20)]
    assert any("bound tightened" in m for m in logs), logs
    logs.clear()
    assert run(make_cfg(short_model, dataset, out, max_length=24), backend, logs) == EXIT_USAGE
    assert any(
        "max_length: the existing run cuts samples at 20 tokens, this run would allow 24" in m
        and "rerun with --max-length 20 (or lower), or use another --output" in m
        for m in logs
    ), logs


class _OOMBackend(SharedBackend):
    """Out of memory for any batch holding the poisoned sample; counts its attempts."""

    def __init__(self, inner, poison: str, error: Exception):
        super().__init__(inner)
        self.poison, self.error, self.calls = poison, error, []

    def extract(self, samples):
        self.calls.append([s.sample_id for s in samples])
        if any(s.sample_id == self.poison for s in samples):
            raise self.error
        return self.inner.extract(samples)


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 37.60 GiB"),
        RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory: you tried to allocate 37600000000 bytes"),
        RuntimeError("out of memory"),
    ],
)
def test_out_of_memory_fails_that_sample_once_never_the_run(tiny_model_dir, dataset, backend, tmp_path, error) -> None:
    poison = sorted(e.sample_id for e in scan_dataset(dataset).entries)[0]
    oom = _OOMBackend(backend.inner, poison, error)
    out = tmp_path / "out"
    assert run(make_cfg(tiny_model_dir, dataset, out, retries=3), oom) == EXIT_FAILED  # one sample missing
    assert set(load_index(str(out))) == {e.sample_id for e in scan_dataset(dataset).entries} - {poison}
    with_poison = [c for c in oom.calls if poison in c]
    assert len(with_poison) == 2 and len(with_poison[0]) > 1 and with_poison[1] == [poison], oom.calls
    (err,) = _errors(out)
    assert err["sample_id"] == poison and err["attempts"] == 1
    assert err["reason"].startswith("out of memory in the forward (not retried):"), err
