"""Preflight: the checks of `hsx extract`'s inputs that need no torch, made before it is imported.

Contract: `check_inputs(cfg)` reads only what the command line names (the model's config.json and
the names of its files, the dataset's file type, the output's file type), writes nothing, and
returns (the model's config, the capture layer ids); every mistake is an InputError whose message
names the option, the path and what to do. Importing this module imports no torch or transformers,
so a mistake is reported at once (importing torch takes seconds, and loading a model minutes).
The runner calls it again (resume.load_inputs): one set of rules for the CLI and for tests.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import stat
from typing import Any

from extraction.inputs import layers as layer_mod
from extraction.inputs.config import ExtractConfig

# A sample's size when neither --max-length nor the model's config.json says (runner/plan.py's too).
UNTRUNCATED_TOKENS = 32768
# What an hf model directory holds its weights in (transformers' from_pretrained formats).
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


class InputError(ValueError):
    """A mistake in what `hsx extract` was given; the message says where and what to do."""


def read_model_config(model_dir: str) -> dict[str, Any]:
    """hidden size, layers, vocab and context (max_position_embeddings; UNTRUNCATED_TOKENS when
    it names none) from config.json (a text_config inside wins for VLM wrappers)."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except OSError as e:
        raise InputError(
            f"{path}: cannot read model config: {e.strerror} (is --model the model's directory?)"
        ) from None
    except (ValueError, RecursionError) as e:
        raise InputError(f"{path}: invalid JSON: {e}") from None
    text = cfg.get("text_config") if isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict) else cfg
    try:
        return {
            "hidden_size": int(text["hidden_size"]),
            "num_layers": int(text["num_hidden_layers"]),
            "vocab_size": int(text["vocab_size"]) if text.get("vocab_size") else None,
            "max_positions": int(text.get("max_position_embeddings") or UNTRUNCATED_TOKENS),
        }
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise InputError(f"{path}: model config lacks {e}") from None


def open_regular_file(path: str | os.PathLike) -> int:
    """A read-only fd of `path`, which must be a regular file: opened without blocking (a FIFO
    there is refused, never waited on), the path the operator named (a link there is followed:
    naming it was their choice). OSError otherwise (EINVAL "not a regular file" for the rest)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_model_dir(cfg: ExtractConfig) -> dict[str, Any]:
    """The model directory: there, with a readable config.json, and (hf backend) weights."""
    model = cfg.model or ""
    if not os.path.isdir(model):
        what = "not a directory" if os.path.exists(model) else "no such directory"
        raise InputError(
            f"--model {model}: {what} (give the directory holding the model's config.json, weights and tokenizer)"
        )
    model_cfg = read_model_config(model)
    if cfg.backend == "hf" and not any(glob.glob(os.path.join(glob.escape(model), p)) for p in WEIGHT_PATTERNS):
        raise InputError(
            f"--model {model}: no weights ({', '.join(WEIGHT_PATTERNS)}) in it: point --model at a complete "
            "model directory (the sglang backend needs only config.json and the tokenizer: its server holds "
            "the weights)"
        )
    return model_cfg


def check_inputs(cfg: ExtractConfig) -> tuple[dict[str, Any], list[int]]:
    """(the model's config, the capture layer ids) when the inputs can start a run; InputError
    naming the first mistake otherwise (see the module's contract)."""
    model_cfg = check_model_dir(cfg)
    try:
        layer_ids = layer_mod.parse_layers(cfg.layers, model_cfg["num_layers"], cfg.layer_convention)
    except layer_mod.LayerSpecError as e:
        raise InputError(f"--layers: {e}") from None
    try:
        os.close(open_regular_file(cfg.dataset or ""))
    except OSError as e:
        raise InputError(f"--dataset {cfg.dataset}: {e.strerror} (give the JSONL file of conversations)") from None
    output = cfg.output or ""
    if os.path.lexists(output) and not os.path.isdir(output):
        raise InputError(
            f"--output {output}: exists and is not a directory (give a directory: a new one is created)"
        )
    return model_cfg, layer_ids
