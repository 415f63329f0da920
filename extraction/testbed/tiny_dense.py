"""Deterministic tiny Llama and Qwen2 targets, for the real SGLang server on a CPU (and the hf backend).

Most EAGLE-3 drafters are trained for Llama 3.x and Qwen 2.5/3 targets; SGLang's CPU engine runs
these dense architectures without AMX (../shared/DESIGN.md section 12), where the DeepSeek-V3
tiny target of tiny.py may not run. Each is written as an HF checkpoint directory - config.json,
bf16 safetensors, and tiny.py's locally trained tokenizer with its chat template (tokenizer files
written by hand with `tokenizer_class: PreTrainedTokenizerFast`, so transformers 4.57 and 5.x
both read them: DESIGN section 5) - which transformers and sglang 0.5.23 load offline.

Shape: hidden 128, LAYERS decoder layers, 4 query heads over 2 KV heads (grouped-query attention,
as the real models), head 32, vocab tiny.VOCAB_SIZE, untied embeddings; Qwen2 adds its q/k/v biases.
With 4 layers the EAGLE-3 default capture ids [2, N//2, N-3] = [2, 2, 1] are not distinct: pass
`--layers 1,2,3` to `hsx extract` and HSX_DUMP_LAYERS=1,2,3 to the server (CAPTURE_LAYERS).
Same seed -> same bytes.

    python -m extraction.testbed.tiny_dense llama OUT_DIR [--seed 0] [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from extraction.testbed.tiny import VOCAB_SIZE, build_tokenizer

ARCHS = ("llama", "qwen2")
HIDDEN = 128
LAYERS = 4
CAPTURE_LAYERS = (1, 2, 3)  # HF hidden_states index = SGLang's capture index, for LAYERS = 4


def config_kwargs(arch: str, hidden: int = HIDDEN, layers: int = LAYERS) -> dict[str, Any]:
    """LlamaConfig / Qwen2Config arguments of the tiny target."""
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; one of {', '.join(ARCHS)}")
    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "qwen2":
        kwargs.pop("head_dim")  # Qwen2Config derives it (hidden // heads)
        kwargs["use_sliding_window"] = False
    return kwargs


def build_tiny_dense(
    arch: str, out_dir: str | os.PathLike, seed: int = 0, hidden: int = HIDDEN, layers: int = LAYERS
) -> Path:
    """Write the tiny `arch` target (config, bf16 safetensors, tokenizer) to out_dir; returns it.
    Built beside out_dir and moved in with config.json last (config.json present = complete)."""
    kwargs = config_kwargs(arch, hidden, layers)  # refuses an unknown arch before writing anything
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp:
        _write(arch, Path(tmp), seed, kwargs)
        for f in sorted(Path(tmp).iterdir(), key=lambda f: f.name == "config.json"):
            os.replace(f, out / f.name)
    return out


def _write(arch: str, out: Path, seed: int, kwargs: dict[str, Any]) -> None:
    import torch
    import transformers

    from extraction.backends.hf import _quiet_transformers

    name = {"llama": "Llama", "qwen2": "Qwen2"}[arch]
    config = getattr(transformers, f"{name}Config")(**kwargs)
    config.architectures = [f"{name}ForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, f"{name}ForCausalLM")(config)
    model = model.to(torch.bfloat16).eval()
    build_tokenizer(out, seed=seed)
    with _quiet_transformers():
        model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)  # nothing seed-dependent in it


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build a tiny Llama or Qwen2 target (HF checkpoint).")
    ap.add_argument("arch", choices=ARCHS)
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=LAYERS)
    args = ap.parse_args(argv)
    print(build_tiny_dense(args.arch, args.out_dir, seed=args.seed, layers=args.layers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
