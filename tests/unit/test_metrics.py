"""The runner's Prometheus textfile (extraction/runner/metrics.py): a real tiny run writes
OUTPUT/metrics.prom and the per-run file in the textfile directory, equal to status.json,
`promtool check metrics` clean, replaced atomically without following a planted link."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hsx_run_helpers import SharedBackend, make_cfg, one_thread, run  # noqa: F401  (one_thread: autouse)
from prometheus_client.parser import text_string_to_metric_families
from promtool import promtool

from extraction.backends.hf import HFBackend
from extraction.inputs.config import ConfigError
from extraction.runner.metrics import METRICS_NAME, render, textfile_name, write_textfile
from extraction.testbed.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_OK, EXIT_PAUSED
from hsx.status import STATES, read_status

N = 12


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """(name, labels) -> value of every sample in an exposition text."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    found = [v for (n, ls), v in samples(text).items() if n == name and set(labels.items()) <= set(ls)]
    assert len(found) == 1, (name, labels, found)
    return found[0]


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> SharedBackend:
    return SharedBackend(HFBackend(tiny_model_dir, [1, 3, 4], dtype="fp32"))


@pytest.fixture
def finished(tiny_model_dir: Path, backend: SharedBackend, tmp_path: Path):
    ds = write_tiny_dataset(tmp_path / "d.jsonl", N, seed=3)
    textfiles = tmp_path / "textfile"
    textfiles.mkdir()
    out = tmp_path / "out"
    cfg = make_cfg(tiny_model_dir, ds, out, metrics_textfile_dir=str(textfiles))
    old = os.umask(0o077)  # a hardened unit's umask: node_exporter must still read the files
    try:
        assert run(cfg, backend) == EXIT_OK
    finally:
        os.umask(old)
    return out, textfiles


def test_finished_run_says_done_equals_total_and_matches_status_json(finished) -> None:
    out, textfiles = finished
    text = (out / METRICS_NAME).read_text()
    per_run = textfiles / textfile_name(str(out))
    assert per_run.read_text() == text
    assert sorted(p.name for p in textfiles.iterdir()) == [per_run.name]  # no temp left behind
    for path in (out / METRICS_NAME, per_run):
        assert path.stat().st_mode & 0o777 == 0o644, path
    status = read_status(str(out))
    output = status["output"]
    assert value(text, "hsx_samples_done", output=output) == value(text, "hsx_samples_planned") == N
    for name, key in [("hsx_samples_done", "done"), ("hsx_samples_planned", "total"),
                      ("hsx_samples_written_total", "written"), ("hsx_samples_failed_total", "errors"),
                      ("hsx_written_bytes_total", "bytes_written"), ("hsx_output_free_bytes", "free_bytes"),
                      ("hsx_output_reserve_bytes", "reserve_bytes"), ("hsx_samples_per_second", "samples_per_s"),
                      ("hsx_tokens_per_second", "tokens_per_s")]:
        assert value(text, name) == status[key], name
    assert value(text, "hsx_state", state="done") == 1
    assert sum(value(text, "hsx_state", state=s) for s in STATES) == 1
    assert value(text, "hsx_remaining_bytes") == 0
    assert value(text, "hsx_resume_bad_shards") == 0
    info = [ls for (n, ls), v in samples(text).items() if n == "hsx_run_info"]
    assert len(info) == 1 and {"model", "layers", "dtype", "run_id", "shard_index", "num_shards"} <= dict(info[0]).keys()
    assert dict(info[0])["layers"] == "1,3,4" and dict(info[0])["dtype"] == "float32"
    assert value(text, "hsx_process_start_time_seconds") <= value(text, "hsx_last_progress_timestamp_seconds")


def test_promtool_check_metrics_is_clean(finished) -> None:
    out, _ = finished
    checked = promtool("check", "metrics", stdin=(out / METRICS_NAME).read_bytes())
    assert checked.returncode == 0 and not checked.stdout.strip() and not checked.stderr.strip(), checked


def test_promtool_check_metrics_sees_a_bad_name() -> None:
    # The check itself can fail: a gauge named like a counter is reported.
    bad = b"# HELP hsx_samples_total x\n# TYPE hsx_samples_total gauge\nhsx_samples_total 1\n"
    checked = promtool("check", "metrics", stdin=bad)
    assert checked.returncode != 0 and b"_total" in checked.stdout + checked.stderr, checked


def test_unknown_values_are_left_out_not_zero(tmp_path: Path) -> None:
    text = render({"state": "starting", "output": "/o", "free_bytes": None, "eta_s": None}, {},
                  {"remaining": None, "last_progress": 1.0, "started": 1.0}).decode()
    names = {n for n, _ in samples(text)}
    assert "hsx_output_free_bytes" not in names and "hsx_eta_seconds" not in names
    assert "hsx_remaining_bytes" not in names and value(text, "hsx_state", state="starting") == 1
    checked = promtool("check", "metrics", stdin=text.encode())
    assert checked.returncode == 0, checked


def test_paused_run_says_so(tiny_model_dir: Path, backend: SharedBackend, tmp_path: Path) -> None:
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 4, seed=4)
    out = tmp_path / "out"
    cfg = make_cfg(tiny_model_dir, ds, out, reserve_bytes="1P")  # the disk is "full" at start-up
    assert run(cfg, backend) == EXIT_PAUSED
    text = (out / METRICS_NAME).read_text()
    assert value(text, "hsx_state", state="paused: disk low") == 1
    assert value(text, "hsx_output_reserve_bytes") == 1 << 50
    assert value(text, "hsx_remaining_bytes") > 0


def test_a_link_at_the_files_name_is_replaced_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    d = tmp_path / "textfile"
    d.mkdir()
    (d / "hsx-x.prom").symlink_to(victim)
    write_textfile(str(d), "hsx-x.prom", b"hsx_up 1\n")
    assert victim.read_text() == "keep me\n"
    assert not (d / "hsx-x.prom").is_symlink() and (d / "hsx-x.prom").read_bytes() == b"hsx_up 1\n"


def test_an_unwritable_textfile_dir_is_logged_once_and_the_run_goes_on(
    tiny_model_dir: Path, backend: SharedBackend, tmp_path: Path
) -> None:
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 4, seed=5)
    missing = tmp_path / "no-such-dir"
    logs: list[str] = []
    cfg = make_cfg(tiny_model_dir, ds, tmp_path / "out", metrics_textfile_dir=str(missing))
    assert run(cfg, backend, logs) == EXIT_OK
    said = [m for m in logs if "cannot write the metrics file" in m]
    assert len(said) == 1 and str(missing) in said[0], logs
    assert (tmp_path / "out" / METRICS_NAME).is_file()


def test_the_textfile_dir_must_be_absolute(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--metrics-textfile-dir must be an absolute path"):
        make_cfg(tiny_model_dir, tmp_path / "d.jsonl", tmp_path / "o", metrics_textfile_dir="relative/dir")


def test_an_output_path_that_is_not_utf8_is_measured_like_any_other(
    tiny_model_dir: Path, backend: SharedBackend, tmp_path: Path
) -> None:
    """A path is bytes: one byte that is not UTF-8 (0xff) once raised UnicodeEncodeError in
    run_id at every start; writing metrics never fails the run."""
    ds = write_tiny_dataset(tmp_path / "d.jsonl", 2, seed=6)
    textfiles = tmp_path / "textfile"
    textfiles.mkdir()
    out = tmp_path / os.fsdecode(b"out-\xff")
    cfg = make_cfg(tiny_model_dir, ds, out, metrics_textfile_dir=str(textfiles))
    assert run(cfg, backend) == EXIT_OK
    text = (out / METRICS_NAME).read_text(encoding="utf-8")
    assert value(text, "hsx_samples_done", output=f"{tmp_path}/out-\\xff") == 2
    assert (textfiles / textfile_name(str(out))).read_bytes() == (out / METRICS_NAME).read_bytes()
