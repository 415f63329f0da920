"""Shared fixtures: the tiny target model and the generated collection, each built once per test
session (a few seconds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# Importing ansible.module_utils.basic (module tests) patches sys.intern, after which a first
# import of torch._dynamo (transformers models) raises "substitute_in_graph expects a function".
# Importing it before any test module keeps the order of collection irrelevant.
import torch._dynamo  # noqa: F401, E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The deterministic tiny DeepSeek-V3-architecture model (seed 0); treat as read-only."""
    from extraction.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def module_doc(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict]:
    """`module_doc(name)`: what `ansible-doc --json hsx.recovery.NAME` shows a user of the generated
    collection (tools/collection/build.py, built once), its doc fragments merged in."""
    from ansible_modules import build_collection

    out = build_collection(tmp_path_factory.mktemp("collection"))
    ansible_doc = Path(sys.executable).with_name("ansible-doc")
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(out))

    def doc(name: str) -> dict:
        fqcn = f"hsx.recovery.{name}"
        proc = subprocess.run([str(ansible_doc), "--json", fqcn], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)[fqcn]

    return doc
