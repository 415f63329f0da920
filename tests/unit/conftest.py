"""Shared fixtures: the tiny target model and the generated collection, each built once per test
session (a few seconds); the runner tests' dataset, its ids and one loaded backend, once per module."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# Importing ansible.module_utils.basic (module tests) patches sys.intern, after which a first
# import of torch._dynamo (transformers models) raises "substitute_in_graph expects a function".
# Importing it before any test module keeps the order of collection irrelevant.
import torch._dynamo  # noqa: F401, E402

if TYPE_CHECKING:
    from hsx_run_helpers import SharedBackend

# The dump hook's fixtures, shared by test_sglang_hook*.py (a module's own fixture of a name wins).
from sglang_hook_helpers import attached, device, form, states  # noqa: E402, F401

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The deterministic tiny DeepSeek-V3-architecture model (seed 0); treat as read-only."""
    from extraction.testbed.tiny import build_tiny_model

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


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hsx_run_helpers.N tiny samples (seed 7), written once per test module."""
    from hsx_run_helpers import N

    from extraction.testbed.tiny import write_tiny_dataset

    return write_tiny_dataset(tmp_path_factory.mktemp("ds") / "d.jsonl", N, seed=7)


@pytest.fixture(scope="module")
def ids(dataset: Path) -> set[str]:
    """The sample ids of `dataset`."""
    from extraction.inputs.dataset import scan_dataset

    return {e.sample_id for e in scan_dataset(dataset).entries}


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> SharedBackend:
    """The tiny model loaded once per test module (fp32, layers 1,3,4), shared by its runs."""
    from hsx_run_helpers import SharedBackend

    from extraction.backends.hf import HFBackend

    return SharedBackend(HFBackend(tiny_model_dir, [1, 3, 4], dtype="fp32"))


@pytest.fixture
def no_hang() -> Iterator[None]:
    """A reader that blocks on a FIFO is a failure, not a hung test run (5 s; the tests of hostile files use it)."""

    def hung(*_a: object) -> None:
        raise TimeoutError("the reader blocked on a FIFO")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(5)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
