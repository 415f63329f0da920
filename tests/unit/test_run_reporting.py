"""What `hsx extract` tells a person outside a terminal: one progress line at a cadence (the
journal of a systemd job), a closing summary on every exit, and an --output that is not made
whole when mistyped."""

from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path

import pytest
from hsx_run_helpers import SharedBackend, make_cfg, one_thread, run  # noqa: F401  (one_thread: autouse)

from extraction.backends.hf import HFBackend
from extraction.runner.progress import MODES, ProgressLines, progress_mode
from extraction.testbed.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_PAUSED, EXIT_SIGINT, EXIT_USAGE
from hsx.status import StatusReporter


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


def test_progress_mode_gives_lines_outside_a_terminal() -> None:
    assert [progress_mode(w, isatty=False) for w in MODES] == ["lines", "bar", "lines", "off"]
    assert [progress_mode(w, isatty=True) for w in MODES] == ["bar", "bar", "lines", "off"]


def test_progress_lines_come_at_the_cadence(tmp_path: Path) -> None:
    """A journal gets a first line at the start, then one per interval, never one per tick."""
    r = StatusReporter(str(tmp_path), total=200, skipped_existing=50, reserve_bytes=0)
    logs: list[str] = []
    now = [1000.0]
    lines = ProgressLines(r, logs.append, 60.0, clock=lambda: now[0])
    lines.start()
    assert logs == ["progress: 50/200 (25.0%) samples, 0.00 samples/s, 0 tokens/s, errors 0, rows skipped 0, "
                    "ETA ? (a line every 60 s: --progress-interval)"]
    for _ in range(19):  # the status thread's 3 s ticks over 57 s: nothing yet
        now[0] += 3
        lines.tick()
    assert len(logs) == 1
    r.add_written(tokens=10, nbytes=100)
    now[0] += 3
    lines.tick()
    assert len(logs) == 2 and logs[1].startswith("progress: 51/200 (25.5%) samples, ")
    now[0] += 59
    lines.tick()
    assert len(logs) == 2


def test_a_run_outside_a_terminal_prints_progress_and_a_closing_summary(
    tiny_model_dir: Path, backend: SharedBackend, tmp_path: Path
) -> None:
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 3, seed=8)
    logs: list[str] = []
    cfg = make_cfg(tiny_model_dir, ds, tmp_path / "out", progress="lines")
    assert run(cfg, backend, logs) == EXIT_OK
    assert "starting: 3 of 3 samples to do; loading the model (hf backend)" in logs
    assert any(m.startswith("progress: 0/3 (0.0%) samples") for m in logs), logs
    assert logs[-1] == "summary: done 3/3 samples (3 written this run, 0 already there), 0 failed, 0 rows skipped; exit 0"


def test_ctrl_c_ends_with_where_it_stopped_and_the_command_to_resume(
    tiny_model_dir: Path, backend: SharedBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 8, seed=9)
    out = tmp_path / "out"
    argv = ["/opt/hsx/venv/bin/hsx", "extract", "--output", str(out), "--model", "my model"]
    monkeypatch.setattr(sys, "argv", argv)
    backend.fail = lambda _samples: os.kill(os.getpid(), signal.SIGINT) and False  # Ctrl-C mid-batch
    logs: list[str] = []
    try:
        code = run(make_cfg(tiny_model_dir, ds, out, batch_size=4, publisher="thread"), backend, logs)
    finally:
        backend.fail = None
    assert code == EXIT_SIGINT
    last = logs[-1]
    assert last.startswith("summary: stopped at 4/8 samples (4 written this run, 0 already there)"), logs
    assert "exit 130 - stopped by SIGINT; run again to resume (finished shards are kept): " in last
    assert last.endswith(shlex.join(argv))


def test_a_pause_and_a_failure_end_with_a_summary_too(
    tiny_model_dir: Path, backend: SharedBackend, tmp_path: Path
) -> None:
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 2, seed=10)
    logs: list[str] = []
    assert run(make_cfg(tiny_model_dir, ds, tmp_path / "p", reserve_bytes="1P"), backend, logs) == EXIT_PAUSED
    assert logs[-1].startswith("summary: paused at 0/2 samples") and f"free space on {tmp_path / 'p'}" in logs[-1]
    backend.fail = lambda _samples: True
    logs.clear()
    try:
        code = run(make_cfg(tiny_model_dir, ds, tmp_path / "f", retries=0), backend, logs)
    finally:
        backend.fail = None
    assert code == EXIT_FAILED
    assert logs[-1].startswith("summary: failed at 0/2 samples (0 written this run, 0 already there), 2 failed")
    assert f"see {tmp_path / 'f' / 'errors.jsonl'}" in logs[-1] and "run again to resume" in logs[-1]
