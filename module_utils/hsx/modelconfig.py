"""A model's config.json read as data (a Hugging Face model directory): its width and length, where
a multimodal model keeps them under `text_config`.

Part of the stdlib-only core: shipped to Ansible hosts as ansible.module_utils.hsx.modelconfig.
"""

from __future__ import annotations

import json
import os
import stat

MAX_CONFIG_BYTES = 1 << 20  # a model's config.json is a few KiB; more is not one


def read_json(model_dir: str) -> object:
    """config.json of the model in `model_dir` (links followed: a hub snapshot's files are links),
    parsed; ValueError naming the file when it cannot be read, is not a regular file, is over
    MAX_CONFIG_BYTES or is not JSON."""
    path = os.path.join(model_dir, "config.json")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the model's config: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(f"{path}: not a regular file")
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the model's config: {exc.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: over {MAX_CONFIG_BYTES} bytes, not a model config")
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
