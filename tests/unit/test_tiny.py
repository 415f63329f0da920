"""The tiny target: deterministic bytes, offline loading, a chat template, a mixed dataset."""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from extraction.cli import main
from extraction.testbed.tiny import tiny_conversations


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert main(["tiny-model", str(tmp_path / "again"), "--seed", "0"]) == 0
    assert main(["tiny-model", str(tmp_path / "other"), "--seed", "1"]) == 0
    ref = _hashes(tiny_model_dir)
    assert set(ref) >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert _hashes(tmp_path / "again") == ref
    other = _hashes(tmp_path / "other")
    assert other["model.safetensors"] != ref["model.safetensors"]
    assert other["tokenizer.json"] != ref["tokenizer.json"]


def test_loads_offline_with_chat_template(tiny_model_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.model_type == "deepseek_v3"
    assert (config.hidden_size, config.num_hidden_layers, config.n_routed_experts) == (64, 8, 8)
    assert (config.first_k_dense_replace, config.num_experts_per_tok, config.n_shared_experts) == (1, 2, 1)
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_rope_head_dim) == (48, 32, 8)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok) == 1024
    msgs = [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello!"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<|bos|><|user|>Hi there.<|end|><|assistant|>Hello!<|end|><|eos|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id == config.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.decode(ids) == text
    # Readable by transformers 4.57 (sglang <= 0.5.9): no TokenizersBackend class name, no list specials.
    tc = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert not isinstance(tc.get("extra_special_tokens", {}), list)


def test_tiny_dataset_deterministic_and_mixed(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert main(["tiny-dataset", str(a), "-n", "60", "--seed", "3"]) == 0
    assert main(["tiny-dataset", str(b), "-n", "60", "--seed", "3"]) == 0
    assert a.read_bytes() == b.read_bytes()
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    assert len(rows) == 60
    assert any("conversations" in r for r in rows) and any("messages" in r for r in rows)
    assert any("id" in r for r in rows) and any("id" not in r for r in rows)
    lengths = {
        sum(len(m.get("content", m.get("value", ""))) for m in r.get("messages", r.get("conversations")))
        for r in rows
    }
    assert max(lengths) > 3 * min(lengths)
    assert tiny_conversations(5, seed=4) != tiny_conversations(5, seed=3)


def test_a_new_user_extracts_from_the_tiny_target_with_defaults(tmp_path: Path) -> None:
    """The three commands as a new user types them, defaults only: the default capture layers of
    the tiny target are distinct, so the extract runs and leaves 4 verified shards."""
    hsx = Path(sys.executable).with_name("hsx")
    hsx = str(hsx) if hsx.exists() else shutil.which("hsx")
    assert hsx, "the hsx console script is not installed"
    typed = ["hsx tiny-model M", "hsx tiny-dataset D -n 4", "hsx extract --model M --dataset D --output O"]
    for line in typed:
        argv = [hsx, *shlex.split(line)[1:]]
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{line!r} exited {done.returncode}:\n{done.stderr}"
    run_json = json.loads((tmp_path / "O" / "run.json").read_text())
    assert run_json["layer_ids"] == [2, 4, 5]  # [2, N//2, N-3] of the 8-layer tiny target
    check = subprocess.run(
        [hsx, "verify", "O", "--level", "full", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 0, check.stderr
    report = json.loads(check.stdout)
    assert (report["ok"], report["bad"], report["missing"]) == (4, [], [])
    assert len(list((tmp_path / "O").rglob("*.pt"))) == 4
