"""A deterministic tiny DeepSeek-V3-architecture target and a conversation set for it.

No model hub is reachable from the lab or CI, yet every part of the pipeline (tokenizer with chat
template, MLA attention, MoE layers, hidden-state capture) must run for real. Same seed -> same
bytes, so tests can compare hashes and shards across builds.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

from hsx.fsutil import atomic_write_bytes

# Special tokens; ids 0.. in this order (the config's bos/eos/pad ids rely on it).
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
BOS, EOS, PAD = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1], SPECIAL_TOKENS[2]

# Role header, content, <|end|>. The assistant turn ends with <|eos|> as well, so the drafter learns
# to stop. Kept free of `{% generation %}` so any transformers version renders it.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

VOCAB_SIZE = 1024

# Decoder layers of the tiny target, chosen so that `hsx extract` works on it with no --layers: the
# EAGLE-3 default capture layers [2, N//2, N-3] must be distinct (6 gives [2, 3, 3], which
# extraction.inputs.layers refuses). 7 would do with three adjacent layers [2, 3, 4]; 8 spreads them
# ([2, 4, 5]) as on a real model, for one more small layer.
LAYERS = 8


def model_config_kwargs(
    vocab_size: int = VOCAB_SIZE, hidden: int = 64, layers: int = LAYERS
) -> dict[str, Any]:
    """DeepseekV3Config arguments of the tiny target; scalable for benchmarks.

    DeepSeek-V3's architecture in miniature: MLA attention (q/kv LoRA ranks, split rope/nope
    heads), one dense layer then MoE layers (8 routed experts, 2 per token, 1 shared), untied
    embeddings; the head counts and LoRA ranks grow with `hidden` for the benchmarks' larger builds.
    """
    scale = hidden // 64 or 1
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=4 * scale if hidden >= 256 else 4,
        num_key_value_heads=4 * scale if hidden >= 256 else 4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=48 * scale,
        kv_lora_rank=32 * scale,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )


# ---------------------------------------------------------------- synthetic text


def _words(rng: random.Random, n: int) -> list[str]:
    letters = "etaoinshrdlucmfwypvbgkqjxz"
    weights = [26 - i for i in range(len(letters))]
    return ["".join(rng.choices(letters, weights, k=rng.randint(1, 9))) for _ in range(n)]


class _Text:
    """Seeded sentence source: a Zipf-ish vocabulary so BPE finds real merges."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.vocab = _words(self.rng, 600)
        self.weights = [1.0 / (i + 1) for i in range(len(self.vocab))]

    def sentence(self) -> str:
        n = self.rng.randint(3, 14)
        words = self.rng.choices(self.vocab, self.weights, k=n)
        text = " ".join(words).capitalize()
        return text + self.rng.choice([".", ".", ".", "?", "!"])

    def paragraph(self, sentences: int) -> str:
        return " ".join(self.sentence() for _ in range(sentences))


# ---------------------------------------------------------------- tokenizer


def build_tokenizer(out_dir: Path, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> None:
    """Train a byte-level BPE on a seeded corpus and write files AutoTokenizer loads offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = _Text(seed)
    corpus = [text.paragraph(3) for _ in range(3000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    # Written by hand rather than by save_pretrained: transformers 5 would write
    # `TokenizersBackend` and list-valued extra_special_tokens, which 4.57 (sglang <= 0.5.9) can't read.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------- model


def build_tiny_model(
    out_dir: str | os.PathLike, seed: int = 0, hidden: int = 64, layers: int = LAYERS
) -> Path:
    """Write the tiny target (config, bf16 safetensors weights, tokenizer) to out_dir; returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Built beside `out`, then moved in with config.json last: callers (and `creates: config.json`
    # in the lab plays, two of which may run at once) take config.json as "complete".
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as tmp:
        _write_tiny_model(Path(tmp), seed, hidden, layers)
        files = sorted(Path(tmp).iterdir(), key=lambda f: f.name == "config.json")
        for f in files:
            os.replace(f, out / f.name)
    return out


def _write_tiny_model(out: Path, seed: int, hidden: int, layers: int) -> None:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    build_tokenizer(out, seed=seed)
    config = DeepseekV3Config(**model_config_kwargs(hidden=hidden, layers=layers))
    config.architectures = ["DeepseekV3ForCausalLM"]
    gen = torch.random.fork_rng(devices=[])
    with gen:
        torch.manual_seed(seed)
        model = DeepseekV3ForCausalLM(config)
    model = model.to(torch.bfloat16).eval()
    from extraction.backends.hf import _quiet_transformers

    with _quiet_transformers():
        model.save_pretrained(out, safe_serialization=True)
    if model.generation_config is not None:
        # Nothing in the generation config is seed-dependent, but keep the directory minimal.
        (out / "generation_config.json").unlink(missing_ok=True)


# ---------------------------------------------------------------- dataset


def tiny_conversations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """n conversations mixing ShareGPT and OpenAI shapes, varied lengths, some with ids."""
    rng = random.Random(seed ^ 0x5EED)
    text = _Text(seed + 1)
    rows: list[dict[str, Any]] = []
    for i in range(n):
        turns = rng.choice([1, 1, 1, 2, 2, 3])
        messages: list[dict[str, str]] = []
        if rng.random() < 0.25:
            messages.append({"role": "system", "content": text.paragraph(1)})
        for _ in range(turns):
            messages.append({"role": "user", "content": text.paragraph(rng.randint(1, 3))})
            messages.append({"role": "assistant", "content": text.paragraph(rng.randint(1, 6))})
        row: dict[str, Any]
        if rng.random() < 0.5:
            names = {"system": "system", "user": "human", "assistant": "gpt"}
            row = {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages]}
        else:
            row = {"messages": messages}
        if rng.random() < 0.5:
            row = {"id": f"tiny-{seed}-{i:06d}", **row}
        rows.append(row)
    return rows


def write_tiny_dataset(path: str | os.PathLike, n: int, seed: int = 0) -> Path:
    """Write tiny_conversations(n, seed) as JSONL, whole or not at all (fsutil.atomic_write_bytes: a
    temp file beside it and a rename), so a reader that finds the file (another make test lane) never
    reads half of it."""
    out = Path(path)
    if out.parent:
        out.parent.mkdir(parents=True, exist_ok=True)
    rows = (json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in tiny_conversations(n, seed))
    atomic_write_bytes(str(out), "".join(rows).encode("utf-8"), durable=False)
    return out
