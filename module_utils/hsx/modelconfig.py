"""A model's config.json read as data (a Hugging Face model directory): its width and length, where
a multimodal model keeps them under `text_config`.

Part of the stdlib-only core: shipped to Ansible hosts as ansible.module_utils.hsx.modelconfig.
"""

from __future__ import annotations

import json
import os

from .fsutil import read_regular

MAX_CONFIG_BYTES = 1 << 20  # a model's config.json is a few KiB; more is not one


def read_json(model_dir: str) -> object:
    """config.json of the model in `model_dir` (links followed: a hub snapshot's files are links),
    parsed; ValueError naming the file when it cannot be read, is not a regular file (a FIFO is
    refused, never waited on), is over MAX_CONFIG_BYTES or is not JSON (fsutil.read_regular)."""
    path = os.path.join(model_dir, "config.json")
    try:
        data = read_regular(path, MAX_CONFIG_BYTES, follow_links=True)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the model's config: {exc.strerror}") from None
    except ValueError as exc:  # over the limit
        raise ValueError(f"{exc}, not a model config") from None
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None


def read_config(model_dir: str) -> dict:
    """read_json's config, which must be a JSON object (ValueError naming the file otherwise)."""
    config = read_json(model_dir)
    if not isinstance(config, dict):
        raise ValueError(f"{os.path.join(model_dir, 'config.json')}: not a JSON object")
    return config


def text_dims(config: dict) -> tuple[int, int]:
    """(hidden_size, max_position_embeddings) of the text model; 0 for what it does not say."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config

    def positive(value: object) -> int:
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    return (positive(text.get("hidden_size")) or positive(config.get("hidden_size")),
            positive(text.get("max_position_embeddings")))
