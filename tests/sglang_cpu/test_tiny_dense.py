"""The tiny Llama / Qwen2 targets (extraction/testbed/tiny_dense.py): same seed, same bytes; they load
offline with transformers as HF checkpoints with the capture layers the tests use; a bad name is
refused before anything is written.

    .venv/bin/pytest tests/sglang_cpu/test_tiny_dense.py -q
"""

from __future__ import annotations

import hashlib
import json

import pytest

from extraction.testbed.tiny_dense import CAPTURE_LAYERS, HIDDEN, LAYERS, build_tiny_dense


def _digest(path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_same_seed_same_bytes_and_it_loads(arch, tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    a = build_tiny_dense(arch, tmp_path / "a")
    b = build_tiny_dense(arch, tmp_path / "b")
    assert _digest(a) == _digest(b)
    assert (
        _digest(build_tiny_dense(arch, tmp_path / "c", seed=1))["model.safetensors"]
        != _digest(a)["model.safetensors"]
    )
    config = json.loads((a / "config.json").read_text())
    assert config["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    assert (
        json.loads((a / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    )
    model = AutoModelForCausalLM.from_pretrained(a).eval()
    tok = AutoTokenizer.from_pretrained(a)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Hi there."}], tokenize=True, return_dict=False
    )
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    assert len(out.hidden_states) == LAYERS + 1 and out.hidden_states[-1].shape[-1] == HIDDEN
    assert max(CAPTURE_LAYERS) < LAYERS and len(set(CAPTURE_LAYERS)) == 3


def test_unknown_arch_is_refused_before_writing(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny architecture 'mistral'"):
        build_tiny_dense("mistral", tmp_path / "m")
    assert not (tmp_path / "m").exists()
