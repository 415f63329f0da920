"""Real torch-written runs and shards for the shard tests, plus ways to damage them."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import torch

from extraction.shards import ShardWriter
from hsx.manifest import RunManifest
from hsx.verify.check import Expect

H, K, VOCAB = 8, 3, 100


def manifest(**overrides) -> RunManifest:
    base = dict(
        model="tiny-deepseek-v3",
        revision="r1",
        hidden_size=H,
        num_layers=6,
        layer_ids=[1, 3, 4],
        layer_convention="hf_hidden_states_index",
        dtype="bfloat16",
        vocab_size=VOCAB,
        tokenizer_hash="t",
        chat_template_hash="c",
        dataset_path="/data/ds.jsonl",
        dataset_hash="d",
    )
    base.update(overrides)
    return RunManifest(**base)


def tensors(length: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, VOCAB, (length,), generator=g),
        "loss_mask": torch.randint(0, 2, (length,), generator=g),
        "hidden_state": torch.randn(length, H, generator=g),
        "aux_hidden_state": torch.randn(length, K * H, generator=g),
    }


def make_run(root: Path, n: int = 4, length: int = 5, **writer_kw) -> tuple[ShardWriter, list]:
    """A run with n good shards written by the real writer; returns (writer, index entries)."""
    w = ShardWriter(root, manifest(), **writer_kw)
    entries = [w.publish(f"s{i:03d}", **tensors(length, seed=i)) for i in range(n)]
    return w, entries


def shard_dict(length: int = 5, seed: int = 0, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    t = tensors(length, seed)
    return {
        "input_ids": t["input_ids"],
        "loss_mask": t["loss_mask"],
        "hidden_state": t["hidden_state"].unsqueeze(0).to(dtype),
        "aux_hidden_state": t["aux_hidden_state"].unsqueeze(0).to(dtype),
    }


def save(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)
    return path


def replace_record(path: Path, suffix: str, data: bytes) -> None:
    """Rewrite a torch.save zip with one record's bytes replaced (a well-formed zip, bad content)."""
    src = zipfile.ZipFile(path)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as out:
        for info in src.infolist():
            out.writestr(info.filename, data if info.filename.endswith(suffix) else src.read(info))
    path.write_bytes(buf.getvalue())


def read_record(path: Path, suffix: str) -> bytes:
    z = zipfile.ZipFile(path)
    (name,) = [n for n in z.namelist() if n.endswith(suffix)]
    return z.read(name)


def flip(path: Path, offset: int, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def expect() -> Expect:
    return Expect(hidden_size=H, num_aux=K, dtype="bfloat16", vocab_size=VOCAB)


def tree(root: Path) -> list[str]:
    """Every file under root with its size, to prove that nothing moved."""
    return sorted(f"{p.relative_to(root)}:{p.stat().st_size}" for p in root.rglob("*") if p.is_file())
