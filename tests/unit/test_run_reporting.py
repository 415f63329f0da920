"""What `hsx extract` tells a person outside a terminal: one progress line at a cadence (the
journal of a systemd job), a closing summary on every exit, and an --output that is not made
whole when mistyped."""

from __future__ import annotations

from pathlib import Path

import pytest
from hsx_run_helpers import SharedBackend, make_cfg, one_thread, run  # noqa: F401  (one_thread: autouse)

from extraction.backends.hf import HFBackend
from extraction.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_USAGE


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> SharedBackend:
    return SharedBackend(HFBackend(tiny_model_dir, [1, 3, 4], dtype="fp32"))


def test_a_mistyped_output_is_not_made_whole(tiny_model_dir: Path, backend: SharedBackend, tmp_path: Path) -> None:
    """Only the output directory itself is made: a parent that does not exist is a typo to fix."""
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 2, seed=7)
    out = tmp_path / "dtaa" / "hsx" / "out"
    logs: list[str] = []
    assert run(make_cfg(tiny_model_dir, ds, out, publisher="thread"), backend, logs) == EXIT_USAGE
    want = f"--output {out}: its parent directory {out.parent} does not exist"
    assert any(want in m and "check the path for a typo" in m for m in logs), logs
    assert not (tmp_path / "dtaa").exists()
