"""Helpers for the runner tests (test_runner*, test_crash, test_diskfull, test_status); the fixtures
the test_runner* modules share (the tiny dataset, its ids, one loaded backend) are in conftest.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from extraction.backends.hf import HFBackend
from extraction.inputs.config import ExtractConfig, build_config
from extraction.runner import Runner
from extraction.shards.verify import verify_output
from hsx.fsutil import find_orphan_temps
from hsx.index import load_index
from hsx.verify.scan import scan_shards

LAYERS = "1,3,4"
N = 20  # samples of the shared tiny dataset


class SharedBackend:
    """One loaded hf backend reused across runs (close() is a no-op); optionally failing."""

    def __init__(self, inner: HFBackend):
        self.inner = inner
        self.name = "hf"
        self.fail: Any = None  # callable(samples) -> bool: raise when it returns True

    def model_info(self):
        return self.inner.model_info()

    def extract(self, samples):
        if self.fail is not None and self.fail(samples):
            raise RuntimeError("injected backend failure")
        return self.inner.extract(samples)

    def close(self) -> None:
        pass


def make_cfg(model: Path, dataset: Path, output: Path, **kw: Any) -> ExtractConfig:
    base = dict(
        model=str(model),
        dataset=str(dataset),
        output=str(output),
        layers=LAYERS,
        dtype="fp32",
        max_length=40,
        batch_size=4,
        status_interval=0.2,
        progress="off",
        retry_backoff=0.01,
    )
    base.update(kw)
    return build_config(base)


def run(
    cfg: ExtractConfig, backend: SharedBackend | None = None, logs: list[str] | None = None, **runner_kw: Any
) -> int:
    """Runner(cfg).run() with `backend` (else the real one), its log lines into `logs`, and the
    Runner's variant arguments (writer_threads, tokenizer_process)."""
    factory = (lambda _cfg, _ids: backend) if backend is not None else None
    kwargs: dict[str, Any] = {"log": (logs.append if logs is not None else (lambda _m: None)), **runner_kw}
    if factory is not None:
        kwargs["backend_factory"] = factory
    return Runner(cfg, **kwargs).run()


def load_shards(output: Path) -> dict[str, dict[str, torch.Tensor]]:
    """sample id -> tensors of every indexed shard."""
    out = {}
    for sid, entry in load_index(str(output)).items():
        out[sid] = torch.load(output / entry.path, weights_only=True)
    return out


def assert_same_shards(output: Path, want: dict[str, dict[str, torch.Tensor]]) -> None:
    """The shards indexed in `output` are `want`'s samples, no other, each tensor bit for bit."""
    got = load_shards(output)
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for sid, tensors in want.items():
        assert got[sid].keys() == tensors.keys(), sid
        for name, tensor in tensors.items():
            assert torch.equal(got[sid][name], tensor), (sid, name)


def assert_complete(output: Path, ids: set[str]) -> None:
    """Every sample exactly once: indexed, one file each, deep-verified, no temps or strays."""
    index = load_index(str(output))
    assert set(index) == ids
    files = scan_shards(str(output))
    assert sorted(files) == sorted(e.path for e in index.values())
    assert find_orphan_temps(str(output)) == []
    report = verify_output(str(output), "deep")
    assert (report.ok, report.bad, report.missing, report.unindexed) == (len(ids), [], [], []), (
        report.to_dict()
    )


def disk_usage_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread in the runner test modules (imported there): on a busy 2-core CI machine
    two spinning OpenMP threads made these runs ~4x slower. Restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)

