"""The runner's CUDA path on a real GPU (never in CI; skipped without CUDA).

    python3 -m pytest tests/gpu/test_gpu_runner.py -q

- `HFBackend.extract_async` (pinned host buffers, non-blocking copies, an event, the NaN/Inf check
  on the device) gives the same bits as the blocking `extract`, and flags non-finite states;
- `hsx extract` on CUDA with parallel writer threads, or with its writer process (states copied
  from the device straight into its pinned shared buffer), writes the same shards, bit for bit,
  as the blocking path with one writer thread, and every shard passes `deep`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from extraction.backends.base import Sample  # noqa: E402
from extraction.backends.hf import HFBackend  # noqa: E402
from extraction.inputs.config import build_config  # noqa: E402
from extraction.runner import Runner  # noqa: E402
from extraction.shards.verify import verify_output  # noqa: E402
from extraction.testbed.tiny import build_tiny_model, write_tiny_dataset  # noqa: E402
from hsx.exitcodes import EXIT_OK  # noqa: E402
from hsx.index import load_index  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
LAYERS = [1, 3, 4]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _samples() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    return [
        Sample(f"s{i}", torch.randint(7, 1024, (n,), generator=g), torch.ones(n, dtype=torch.long))
        for i, n in enumerate([37, 9, 64, 64, 20])
    ]


def test_async_same_bits_as_blocking_and_flags_nan(model_dir: Path) -> None:
    backend = HFBackend(model_dir, LAYERS, dtype="bf16", device="cuda")
    samples = _samples()
    sync = backend.extract(samples)
    final, aux, lengths = backend.forward_states(samples)  # reference: a plain blocking .cpu()
    for row, n in enumerate(lengths):
        assert torch.equal(sync[row].hidden_state, final[row, :n].cpu())
        assert torch.equal(sync[row].aux_hidden_state, aux[row, :n].cpu())
    del final, aux
    pending = [backend.extract_async(samples) for _ in range(3)]  # queued back to back
    for p in pending:
        got = p.wait()
        for a, b in zip(sync, got, strict=True):
            assert a.sample_id == b.sample_id and b.finite is True
            assert torch.equal(a.hidden_state, b.hidden_state)
            assert torch.equal(a.aux_hidden_state, b.aux_hidden_state)
            assert b.hidden_state.device.type == "cpu" and b.hidden_state.is_pinned()
    with torch.no_grad():
        backend.model.norm.weight[0] = float("nan")
    flagged = backend.extract_async(samples).wait()
    assert [r.finite for r in flagged] == [False] * len(samples)


class _Blocking:
    """The hf backend through its blocking extract only (no extract_async): the reference path."""

    name = "hf"

    def __init__(self, inner: HFBackend):
        self.inner = inner

    def model_info(self):
        return self.inner.model_info()

    def extract(self, samples):
        return self.inner.extract(samples)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_runner_on_cuda_parallel_writers_same_shards(
    model_dir: Path, tmp_path: Path, monkeypatch, writer: str
) -> None:
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 60, seed=3)
    kw = dict(
        model=str(model_dir),
        dataset=str(ds),
        layers="1,3,4",
        dtype="bf16",
        device="cuda",
        max_length=128,
        batch_size=8,
        progress="off",
    )
    ref = tmp_path / "ref"
    r = Runner(
        build_config({**kw, "output": str(ref), "publisher": "thread"}),
        backend_factory=lambda c, ids: _Blocking(HFBackend(c.model, ids, dtype=c.dtype, device=c.device)),
        log=lambda _m: None,
        writer_threads=1,
    )
    assert r.run() == EXIT_OK
    out = tmp_path / "out"
    logs: list[str] = []
    r = Runner(
        build_config({**kw, "output": str(out), "publisher": writer}), log=logs.append, writer_threads=4
    )
    assert r.run() == EXIT_OK
    # the writer process's buffer was pinned, and the states copied into it directly
    assert ("pin_s" in r.timings) == (writer == "process"), logs
    want, got = load_index(str(ref)), load_index(str(out))
    assert set(want) == set(got) and len(got) == 60
    for sid, entry in want.items():
        a = torch.load(ref / entry.path, weights_only=True)
        b = torch.load(out / got[sid].path, weights_only=True)
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (sid, key)
    report = verify_output(str(out), "deep")
    assert report.exit_code == 0, report.to_dict()
