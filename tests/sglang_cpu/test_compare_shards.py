"""compare_shards.py, the sglang-vs-hf check of the real server's tests: on two small outputs written
with the project's index writer (no model, no server)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_shards  # noqa: E402

from hsx.index import IndexEntry, append_index, index_record  # noqa: E402
from hsx.layout import shard_relpath  # noqa: E402


def write(out: Path, shards: dict[str, dict[str, torch.Tensor]]) -> Path:
    records = []
    for sample_id, shard in shards.items():
        rel = shard_relpath(sample_id)
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        torch.save(shard, out / rel)
        size = os.path.getsize(out / rel)
        records.append(index_record(IndexEntry(sample_id, rel, size, "crc32:00000000", len(shard["input_ids"]))))
    append_index(str(out), records, fsync=False)
    return out


def shard(tokens: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    states = torch.randn(tokens, 4 * 8, generator=g)
    return {
        "input_ids": torch.arange(tokens),
        "loss_mask": torch.ones(tokens, dtype=torch.long),
        "hidden_state": (states[:, :8] * scale).bfloat16(),
        "aux_hidden_states": (states[:, 8:] * scale).bfloat16(),
    }


def test_equal_within_bf16_and_longer_than_a_chunk(tmp_path):
    want = write(tmp_path / "hf", {"a": shard(70), "b": shard(10)})
    got = write(tmp_path / "sg", {"a": shard(70, 1.01), "b": shard(10)})  # 1%: a few bf16 steps
    figures = compare_shards.compare(got, want, samples=2, longer_than=64)
    assert figures["longest"] == 70 and 0 < figures["worst_rel"] <= compare_shards.BF16_TOL
    assert figures["bit_equal"]["hidden_state"] == 1 and set(figures["bit_equal"]) == {
        "hidden_state", "aux_hidden_states[0]", "aux_hidden_states[1]", "aux_hidden_states[2]"}
    assert compare_shards.main([str(got), str(want), "--samples", "2"]) == 0


def test_a_state_off_by_more_than_the_tolerance_is_named(tmp_path):
    want = write(tmp_path / "hf", {"a": shard(12)})
    bad = shard(12)
    bad["aux_hidden_states"][:, 16:] *= 1.1  # the third captured layer only
    got = write(tmp_path / "sg", {"a": bad})
    with pytest.raises(AssertionError, match=r"a aux_hidden_states\[2\]: max\|a-b\|/max\|b\| = 0\.09"):
        compare_shards.compare(got, want)


def test_ids_samples_and_chunking_are_checked(tmp_path):
    want = write(tmp_path / "hf", {"a": shard(12)})
    other = shard(12)
    other["input_ids"][3] = 99
    with pytest.raises(AssertionError, match="'a', 'input_ids'"):
        compare_shards.compare(write(tmp_path / "ids", {"a": other}), want)
    with pytest.raises(AssertionError, match="sample ids differ"):
        compare_shards.compare(write(tmp_path / "ids2", {"z": shard(12)}), want)
    with pytest.raises(AssertionError, match="1 samples in .*, not 2"):
        compare_shards.compare(want, want, samples=2)
    with pytest.raises(AssertionError, match="no sample is longer than 64 tokens .longest 12."):
        compare_shards.compare(want, want, longer_than=64)
