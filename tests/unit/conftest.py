"""Shared fixtures: the tiny target model, built once per test session (a few seconds)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Importing ansible.module_utils.basic (module tests) patches sys.intern, after which a first
# import of torch._dynamo (transformers models) raises "substitute_in_graph expects a function".
# Importing it before any test module keeps the order of collection irrelevant.
import torch._dynamo  # noqa: F401, E402

# The dump hook's fixtures, shared by test_sglang_hook*.py (a module's own fixture of a name wins).
from sglang_hook_helpers import attached, device, form, states  # noqa: E402, F401

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The deterministic tiny DeepSeek-V3-architecture model (seed 0); treat as read-only."""
    from extraction.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)
