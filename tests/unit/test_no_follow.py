"""Root follows no link inside OUTPUT (issue #30, item 6).

The job runs as root and OUTPUT (and /data) may be writable by other users, or left odd by a crash.
Each test plants a symlink where the code would write - pointing at a directory outside OUTPUT
that stands for /etc - runs the operation as the code does, and checks that nothing there was
written, moved or deleted, and that any refusal says what it found. OUTPUT itself may be a link
(to another disk): it is followed; nothing below it is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from hsx_run_helpers import make_cfg, run
from shard_helpers import make_run, manifest, tensors

from extraction.export import view as ev
from extraction.process.outputlock import LOCK_NAME, OutputLock
from extraction.runner.lifecycle import Lifecycle, RunError
from extraction.shards import ShardWriter, remove_orphan_temps
from extraction.testbed.tiny import write_tiny_dataset
from hsx.exitcodes import EXIT_USAGE
from hsx.index import append_index, index_record, load_index
from hsx.layout import INDEX_NAME, QUARANTINE_DIR, SHARDS_DIR, bucket_of
from hsx.status import ERRORS_NAME, STATUS_NAME, StatusReporter, read_status
from hsx.verify import verify_output

REPO = Path(__file__).resolve().parents[2]
REFUSED = "is a symlink: refusing to write through it"


@pytest.fixture
def etc(tmp_path: Path) -> Path:
    """A directory outside OUTPUT standing for /etc: one file and one subdirectory."""
    d = tmp_path / "etc"
    (d / "cron.d").mkdir(parents=True)
    (d / "passwd").write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    return d


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every entry under `root` (not following links): files' bytes, links' targets, dirs."""
    found: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            rel = str(p.relative_to(root))
            found[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return found


@pytest.fixture
def out(tmp_path: Path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d


# --- the lock: OUTPUT/extract.lock -----------------------------------------------------------
@pytest.mark.parametrize("target", ["passwd", "new-file"])
def test_lock_file_that_is_a_link_is_refused(out, etc, target):
    before = snapshot(etc)
    (out / LOCK_NAME).symlink_to(etc / target)
    lock = OutputLock(str(out))
    with pytest.raises(OSError, match=rf"{out}/extract\.lock {REFUSED}"):
        lock.acquire()
    lock.release()
    assert snapshot(etc) == before


# --- status.json: its temp -------------------------------------------------------------------
def test_status_temp_name_cannot_be_planted(out, etc):
    """The temp was `status.json.<pid>.tmp`, opened following links: planted, root wrote the status
    into the link's target. Now its name is unpredictable and it is created O_EXCL|O_NOFOLLOW."""
    before = snapshot(etc)
    (out / f"{STATUS_NAME}.{os.getpid()}.tmp").symlink_to(etc / "passwd")
    reporter = StatusReporter(str(out), total=3, skipped_existing=0, reserve_bytes=0)
    reporter.write()
    assert snapshot(etc) == before
    assert not (out / STATUS_NAME).is_symlink() and read_status(str(out))["total"] == 3


def test_status_json_that_is_a_link_is_replaced_not_followed(out, etc):
    before = snapshot(etc)
    (out / STATUS_NAME).symlink_to(etc / "passwd")
    StatusReporter(str(out), total=3, skipped_existing=0, reserve_bytes=0).write()
    assert snapshot(etc) == before
    assert not (out / STATUS_NAME).is_symlink() and read_status(str(out))["total"] == 3


# --- errors.jsonl ----------------------------------------------------------------------------
def test_errors_jsonl_that_is_a_link_is_refused(out, etc):
    before = snapshot(etc)
    (out / ERRORS_NAME).symlink_to(etc / "passwd")
    life = Lifecycle(SimpleNamespace(output=str(out)), lambda _m: None, {})
    with pytest.raises(RunError, match=rf"{out}/errors\.jsonl {REFUSED}"):
        life.error({"kind": "row", "reason": "test"})
    assert snapshot(etc) == before


# --- the index -------------------------------------------------------------------------------
def test_index_that_is_a_link_is_refused(out, etc):
    before = snapshot(etc)
    _, (entry,) = make_run(out, n=1)
    (out / INDEX_NAME).unlink()
    (out / INDEX_NAME).symlink_to(etc / "passwd")
    with pytest.raises(OSError, match=rf"{out}/index\.jsonl {REFUSED}"):
        append_index(str(out), [index_record(entry)])
    with pytest.raises(OSError, match=rf"{out}/index\.jsonl {REFUSED}"):
        w = ShardWriter(out, manifest())
        w.publish("s001", **tensors(5))
    assert snapshot(etc) == before


# --- the shard writer: shards/ and its buckets ------------------------------------------------
def test_extract_refuses_an_output_whose_shards_dir_is_a_link(tiny_model_dir, out, etc):
    """As a user meets it: `hsx extract` stops before writing anything, saying what it found."""
    before = snapshot(etc)
    (out / SHARDS_DIR).symlink_to(etc, target_is_directory=True)
    dataset = write_tiny_dataset(out.parent / "d.jsonl", 2, seed=1)
    logs: list[str] = []
    assert run(make_cfg(tiny_model_dir, dataset, out), logs=logs) == EXIT_USAGE
    assert any(f"{out}/shards {REFUSED}" in line for line in logs), logs
    assert snapshot(etc) == before


def test_shards_dir_that_is_a_link_is_refused(out, etc):
    before = snapshot(etc)
    (out / SHARDS_DIR).symlink_to(etc, target_is_directory=True)
    with pytest.raises(OSError, match=rf"{out}/shards {REFUSED}"):
        w = ShardWriter(out, manifest())
        w.publish("a", **tensors(5))
    assert snapshot(etc) == before


def test_bucket_that_is_a_link_is_refused(out, etc):
    before = snapshot(etc)
    (out / SHARDS_DIR).mkdir()
    (out / SHARDS_DIR / bucket_of("a")).symlink_to(etc, target_is_directory=True)
    w = ShardWriter(out, manifest())
    with pytest.raises(OSError, match=rf"{out}/shards/{bucket_of('a')} {REFUSED}"):
        w.publish("a", **tensors(5))
    assert snapshot(etc) == before and load_index(out) == {}


def test_bucket_swapped_for_a_link_while_writing_is_not_followed(out, etc):
    """The writer keeps each bucket open (one open per bucket, not per shard): shards go into the
    folder it opened, whatever has since been put at its name."""
    before = snapshot(etc)
    w, (first,) = make_run(out, n=1)
    bucket = out / SHARDS_DIR / bucket_of("s000")
    bucket.rename(out / "moved")
    bucket.symlink_to(etc, target_is_directory=True)
    sid = next(f"x{i}" for i in range(1000) if bucket_of(f"x{i}") == bucket_of("s000"))
    entry = w.publish(sid, **tensors(5))
    w.close()
    assert snapshot(etc) == before
    assert (out / "moved" / os.path.basename(entry.path)).is_file()


# --- orphan temps ----------------------------------------------------------------------------
def test_orphan_temp_removal_does_not_delete_behind_a_shards_link(out, etc):
    (etc / ".passwd.1.abcd0.tmp").write_bytes(b"not ours")
    (etc / "cron.d" / ".job.1.abcd0.tmp").write_bytes(b"not ours either")
    before = snapshot(etc)
    (out / SHARDS_DIR).symlink_to(etc, target_is_directory=True)
    try:
        remove_orphan_temps(out)
    except OSError as e:
        assert REFUSED in str(e)
    assert snapshot(etc) == before


# --- quarantine ------------------------------------------------------------------------------
def _bad_run(out: Path) -> str:
    """A run of two shards, one truncated (bad at `quick`); the bad one's relative path."""
    w, entries = make_run(out, n=2)
    w.close()
    bad = out / entries[1].path
    os.truncate(bad, bad.stat().st_size - 7)
    return entries[1].path


def test_quarantine_dir_that_is_a_link_is_refused(out, etc):
    before = snapshot(etc)
    bad = _bad_run(out)
    (out / QUARANTINE_DIR).symlink_to(etc, target_is_directory=True)
    report = verify_output(str(out), "quick", quarantine=True)
    assert snapshot(etc) == before
    assert (out / bad).is_file() and report.quarantined == []
    assert any(f"{out}/quarantine {REFUSED}" in e for e in report.errors), report.errors
    assert report.exit_code == 2


def test_quarantine_moves_and_deletes_nothing_behind_a_shards_link(out, etc):
    bad = _bad_run(out)
    (out / SHARDS_DIR).rename(etc / "shards")  # the tree behind the link: not the output's
    old_temp = etc / "shards" / ".passwd.1.abcd0.tmp"
    old_temp.write_bytes(b"not ours")
    os.utime(old_temp, (time.time() - 3600,) * 2)
    before = snapshot(etc)
    (out / SHARDS_DIR).symlink_to(etc / "shards", target_is_directory=True)
    report = verify_output(str(out), "quick", quarantine=True, orphan_min_age=0)
    assert snapshot(etc) == before, report.to_dict()
    assert not (out / QUARANTINE_DIR).exists() or snapshot(out / QUARANTINE_DIR) == {}
    assert any(f"{out}/shards {REFUSED}" in e for e in report.errors), report.errors
    assert (etc / bad).is_file()


# --- export-view: DEST/export.json, mapping.jsonl, the lock, the link tree --------------------
@pytest.fixture
def view(tmp_path: Path) -> tuple[Path, Path, ShardWriter]:
    """An output of three shards and a view of it (symlinks); the writer, to add more."""
    o = tmp_path / "run"
    w, _ = make_run(o, n=3)
    dest = tmp_path / "view"
    ev.export_view([str(o)], str(dest), level="quick")
    return o, dest, w


def _export(o: Path, dest: Path) -> ev.ExportReport:
    return ev.export_view([str(o)], str(dest), level="quick")


def test_export_lock_that_is_a_link_is_refused(tmp_path, etc):
    o = tmp_path / "run"
    make_run(o, n=2)[0].close()
    dest = tmp_path / "view"
    dest.mkdir()
    before = snapshot(etc)
    (dest / ev.LOCK_NAME).symlink_to(etc / "new-file")
    with pytest.raises((OSError, ev.ExportError), match=rf"{dest}/\.hsx-export\.lock {REFUSED}"):
        _export(o, dest)
    assert snapshot(etc) == before


def test_export_mapping_that_is_a_link_is_refused(view, etc):
    o, dest, w = view
    w.publish("s003", **tensors(5))
    before = snapshot(etc)
    (dest / ev.MAPPING_NAME).unlink()
    (dest / ev.MAPPING_NAME).symlink_to(etc / "mapping")
    with pytest.raises((OSError, ev.ExportError), match=rf"{dest}/mapping\.jsonl {REFUSED}"):
        _export(o, dest)
    assert snapshot(etc) == before


def test_export_meta_that_is_a_link_is_refused(view, etc):
    o, dest, _ = view
    (etc / "export.json").write_bytes((dest / ev.META_NAME).read_bytes())
    before = snapshot(etc)
    (dest / ev.META_NAME).unlink()
    (dest / ev.META_NAME).symlink_to(etc / "export.json")
    with pytest.raises((OSError, ev.ExportError), match=rf"{dest}/export\.json {REFUSED}"):
        _export(o, dest)
    assert snapshot(etc) == before


def test_export_group_dir_that_is_a_link_is_refused(view, etc):
    o, dest, w = view
    w.publish("s003", **tensors(5))
    group = dest / "rows_0-2000"
    group.rename(etc / "rows_0-2000")  # what the link leads to: not the view's
    before = snapshot(etc)
    group.symlink_to(etc / "rows_0-2000", target_is_directory=True)
    with pytest.raises((OSError, ev.ExportError), match=rf"{group} {REFUSED}"):
        _export(o, dest)
    assert snapshot(etc) == before


# --- the storage probe in /data's root (roles/storage_guard) ---------------------------------
def _probe_script() -> str:
    """What the role's probe task runs: the write_probe module's hostfs.write_probe."""
    tasks = yaml.safe_load((REPO / "roles/storage_guard/tasks/probe.yml").read_text())
    assert "write_probe" in tasks[0], tasks[0]
    return "from hsx.hostfs import write_probe\nsys.exit(write_probe(sys.argv[1]))\n"


def test_storage_probe_writes_nothing_through_a_planted_link(tmp_path, etc):
    """The probe file was `.hsx-write-probe.<pid>`, opened following links: a user who can write
    /data plants that name for the next pids and root overwrites the link's target with 4 KiB of
    random bytes (then deletes the link). Here the planted link names the probe's very pid."""
    data = tmp_path / "data"
    data.mkdir()
    before = snapshot(etc)
    plant = (
        "import os, sys\n"
        f"os.symlink({str(etc / 'passwd')!r}, os.path.join(sys.argv[1], '.hsx-write-probe.%d' % os.getpid()))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", plant + _probe_script(), str(data)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert snapshot(etc) == before
    left = list(data.iterdir())  # the planted link (not the probe's to remove), no probe file
    assert len(left) == 1 and left[0].is_symlink(), left


# --- OUTPUT itself may be a link; a FIFO is no file of ours ------------------------------------
def test_output_itself_may_be_a_link_to_another_disk(tmp_path, etc):
    """OUTPUT is the operator's path: a link there (to another disk, say) is followed; only what
    lies below it is not."""
    real = tmp_path / "disk2" / "out"
    real.mkdir(parents=True)
    out = tmp_path / "out"
    out.symlink_to(real, target_is_directory=True)
    lock = OutputLock(str(out))
    assert lock.acquire() is None
    w, entries = make_run(out, n=2)
    StatusReporter(str(out), total=2, skipped_existing=0, reserve_bytes=0).write()
    Lifecycle(SimpleNamespace(output=str(out)), lambda _m: None, {}).error({"kind": "row", "reason": "t"})
    w.close()
    os.truncate(real / entries[1].path, 10)
    report = verify_output(str(out), "quick", quarantine=True)
    lock.release()
    assert report.errors == [] and report.quarantined == [f"quarantine/{bucket_of('s001')}/s001.pt"]
    assert set(load_index(real)) == {"s000"}
    assert {p.name for p in real.iterdir()} >= {LOCK_NAME, STATUS_NAME, ERRORS_NAME, INDEX_NAME, SHARDS_DIR}


def test_a_fifo_at_the_index_is_refused_not_waited_on(out):
    _, (entry,) = make_run(out, n=1)
    (out / INDEX_NAME).unlink()
    os.mkfifo(out / INDEX_NAME)

    def hung(*_a):  # before: open(O_WRONLY) of a FIFO waits for a reader, forever
        raise TimeoutError("append_index waited on the FIFO")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        with pytest.raises(OSError, match=rf"{out}/index\.jsonl is not a regular file: refusing"):
            append_index(str(out), [index_record(entry)])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_ending_a_torn_index_line_never_writes_through_a_link(tmp_path) -> None:
    """The resume's repair of a torn last index line (runner/resume.py) opens the index itself."""
    from extraction.runner.resume import end_torn_index_line
    from hsx.fsutil import LinkRefused

    out, target = tmp_path / "out", tmp_path / "etc-file"
    out.mkdir()
    target.write_bytes(b"no newline at the end")
    (out / "index.jsonl").symlink_to(target)
    with pytest.raises(LinkRefused):
        end_torn_index_line(str(out))
    assert target.read_bytes() == b"no newline at the end"
