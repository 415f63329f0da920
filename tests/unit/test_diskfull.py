"""A really full disk (a size-limited tmpfs): pause with exit 75, no partial shard, then resume."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hsx_run_helpers import (
    SharedBackend,
    assert_complete,
    make_cfg,
    one_thread,  # noqa: F401  (autouse)
    run,
)

from extraction.backends.hf import HFBackend
from extraction.inputs.dataset import scan_dataset
from extraction.testbed.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_OK, EXIT_PAUSED
from hsx.fsutil import find_orphan_temps
from hsx.index import load_index
from hsx.status import read_status
from hsx.verify.scan import scan_shards

N = 16  # ~40 KB per shard at 32 tokens, fp32, H=64, k=3


def _mount(target: Path, size: str) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "hsx-test", str(target)], check=True)


@pytest.fixture
def small_fs(tmp_path: Path, request):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        _mount(mnt, request.param)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture(scope="module")
def env(tiny_model_dir: Path, tmp_path_factory):
    ds = write_tiny_dataset(tmp_path_factory.mktemp("df") / "d.jsonl", N, seed=5)
    backend = SharedBackend(HFBackend(tiny_model_dir, [1, 3, 4], dtype="fp32"))
    return tiny_model_dir, ds, backend, {e.sample_id for e in scan_dataset(ds).entries}


def _grow(mnt: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(mnt)], check=True)


def _no_partial(out: Path) -> None:
    assert find_orphan_temps(str(out)) == []
    index = load_index(str(out))
    assert sorted(scan_shards(str(out))) == sorted(e.path for e in index.values())
    from extraction.shards.verify import verify_output

    report = verify_output(str(out), "full")
    assert report.bad == [] and report.missing == [] and report.ok == len(index)


@pytest.mark.parametrize("small_fs", ["800k"], indirect=True)
def test_guard_pauses_before_the_disk_is_full(small_fs: Path, env) -> None:
    model, ds, backend, ids = env
    out = small_fs / "out"
    # Default reserve: max(2% of 800k, 10 x ~40 KB shard) -> stops with room to spare.
    assert run(make_cfg(model, ds, out, max_length=32, batch_size=2), backend) == EXIT_PAUSED
    status = read_status(str(out))
    assert status["state"] == "paused: disk low"
    assert "free" in status["message"] and "reserve" in status["message"]
    assert status["free_bytes"] > 0 and status["reserve_bytes"] > 0
    done = len(load_index(str(out)))
    assert 0 < done < N
    _no_partial(out)
    _grow(small_fs, "8m")
    assert run(make_cfg(model, ds, out, max_length=32, batch_size=2), backend) == EXIT_OK
    assert read_status(str(out))["skipped_existing"] == done
    assert_complete(out, ids)


@pytest.mark.parametrize("small_fs", ["400k"], indirect=True)
def test_enospc_mid_write_leaves_no_partial_shard(small_fs: Path, env, monkeypatch) -> None:
    model, ds, backend, ids = env
    out = small_fs / "out"
    logs: list[str] = []
    # No reserve and a guard that thinks shards are free (as when another process fills the
    # disk between check and write): the writer runs into ENOSPC inside torch.save or the index.
    monkeypatch.setattr("extraction.publish.publisher.estimate_shard_bytes", lambda *a: 0)
    code = run(make_cfg(model, ds, out, max_length=32, batch_size=2, reserve_bytes=0), backend, logs)
    assert code == EXIT_PAUSED, logs
    assert any("disk full" in m for m in logs), logs
    assert read_status(str(out))["state"] == "paused: disk low"
    assert 0 < len(load_index(str(out))) < N
    _no_partial(out)
    _grow(small_fs, "8m")
    assert run(make_cfg(model, ds, out, max_length=32, batch_size=2, reserve_bytes=0), backend) == EXIT_OK
    assert_complete(out, ids)
