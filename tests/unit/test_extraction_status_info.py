"""library/extraction_status_info: progress from status.json + the index, as the playbooks see it."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
from ansible.module_utils.testing import patch_module_args
from ansible_modules import load_module

from hsx.index import encode_index_line
from hsx.layout import INDEX_NAME
from hsx.status import now_iso, write_json_atomic

extraction_status = load_module("extraction_status_info")


def plant(out: Path, done: int, status: dict | None, torn_tail: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text("{}")
    with open(out / INDEX_NAME, "wb") as f:
        for i in range(done):
            f.write(encode_index_line({"id": f"s{i}", "path": f"shards/00/s{i}.pt", "size": 1000 + i,
                                       "checksum": "crc32:00000000", "num_tokens": 10}))
        if torn_tail:
            f.write(b'{"id": "half')
    if status is not None:
        write_json_atomic(str(out / "status.json"), status)


def status(state="running", done=5, total=10, history=None, pid=None, age=0.0):
    now = time.time()
    return {"state": state, "done": done, "total": total, "samples_per_s": 2.0, "eta_s": 2.5,
            "pid": pid or os.getpid(), "host": socket.gethostname(), "updated_at": now_iso(now - age),
            "history": history if history is not None else [[now - 30, done - 2], [now - 5, done]],
            "message": ""}


def test_running_job_with_recent_progress(tmp_path):
    plant(tmp_path, 5, status())
    r = extraction_status.ExtractionStatus(str(tmp_path), progress_window=60).read()
    assert (r["done"], r["total"], r["remaining"]) == (5, 10, 5)
    assert r["pid_alive"] is True
    assert r["making_progress"] is True
    assert r["bytes_per_sample"] == (sum(1000 + i for i in range(5))) // 5
    assert 4 <= r["last_progress_age_s"] <= 7


def test_stale_progress_is_not_progress(tmp_path):
    now = time.time()
    plant(tmp_path, 5, status(history=[[now - 600, 3], [now - 500, 5], [now - 1, 5]]))
    r = extraction_status.ExtractionStatus(str(tmp_path), progress_window=60).read()
    assert r["making_progress"] is False
    assert r["last_progress_age_s"] >= 499


def test_dead_process_is_not_progress(tmp_path):
    plant(tmp_path, 5, status(pid=2**22 + 12345))
    r = extraction_status.ExtractionStatus(str(tmp_path), progress_window=60).read()
    assert r["pid_alive"] is False
    assert r["making_progress"] is False


def test_paused_disk_low_reports_the_message(tmp_path):
    st = status(state="paused: disk low")
    st["message"] = "free 1.0 GiB < reserve 2.0 GiB"
    plant(tmp_path, 5, st)
    r = extraction_status.ExtractionStatus(str(tmp_path), progress_window=60).read()
    assert r["state"] == "paused: disk low" and "reserve" in r["message"]
    assert r["making_progress"] is False


def test_index_is_the_truth_for_done_and_a_torn_tail_is_tolerated(tmp_path):
    plant(tmp_path, 7, status(done=3), torn_tail=True)
    r = extraction_status.ExtractionStatus(str(tmp_path), progress_window=60).read()
    assert r["done"] == 7 and r["index_bad_lines"] == 0


def test_baseline_requires_growth(tmp_path):
    plant(tmp_path, 5, status())
    assert not extraction_status.ExtractionStatus(str(tmp_path), 60, baseline_done=5).read()["making_progress"]
    assert extraction_status.ExtractionStatus(str(tmp_path), 60, baseline_done=4).read()["making_progress"]


def test_missing_output_and_missing_status(tmp_path):
    r = extraction_status.ExtractionStatus(str(tmp_path / "nope"), 60).read()
    assert r["exists"] is False and r["done"] == 0 and "does not exist" in r["message"]
    plant(tmp_path, 2, None)
    r = extraction_status.ExtractionStatus(str(tmp_path), 60).read()
    assert r["done"] == 2 and r["state"] == "none" and "no readable status.json" in r["message"]


def test_it_names_the_textfile_the_run_writes_also_where_nothing_ran(tmp_path):
    """roles/extraction_job removes the metrics of an output the job left by this name: the runner's."""
    from extraction.runner.metrics import textfile_name  # the name the runner writes

    for out in (tmp_path / "nope", tmp_path):
        r = extraction_status.ExtractionStatus(str(out), 60).read()
        assert r["textfile"] == textfile_name(str(out)) and r["textfile"].startswith("hsx-"), r
    assert extraction_status.ExtractionStatus(f"{tmp_path}/", 60).read()["textfile"] == textfile_name(str(tmp_path))


def test_module_entry_point_is_check_mode_safe(tmp_path, capsys):
    plant(tmp_path, 3, status(done=3))
    before = sorted(os.listdir(tmp_path))
    with patch_module_args({"path": str(tmp_path), "_ansible_check_mode": True}):
        with pytest.raises(SystemExit) as exc:
            extraction_status.main()
    assert exc.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["changed"] is False and out["done"] == 3
    assert sorted(os.listdir(tmp_path)) == before


def test_a_malformed_status_is_a_verdict_with_the_reason(tmp_path):
    """Issue #30: a status.json that is not a status (a JSON list here) used to crash the module
    (recover.yml then failed at assess); now it reads as no status, saying why."""
    plant(tmp_path, 2, None)
    (tmp_path / "status.json").write_text("[1, 2]")
    r = extraction_status.ExtractionStatus(str(tmp_path), 60).read()
    assert r["done"] == 2 and r["state"] == "none"
    assert "no readable status.json" in r["message"] and "not a JSON object" in r["message"]


def test_output_dir_still_names_the_output_as_an_alias_of_path(tmp_path, capsys):
    """Issue #42 item 2: `path`, as in shard_verify; playbooks written with `output_dir` keep working."""
    plant(tmp_path, 2, status(done=2))
    with patch_module_args({"output_dir": str(tmp_path)}):
        with pytest.raises(SystemExit) as exc:
            extraction_status.main()
    out = json.loads(capsys.readouterr().out)
    assert exc.value.code == 0 and out["done"] == 2, out
    assert out["invocation"]["module_args"]["path"] == str(tmp_path)


def test_per_bucket_counts_and_finished_buckets_come_from_the_node_never_guessed(tmp_path):
    from hsx.bucketcount import count_totals, write_bucket_totals
    from hsx.buckets import bucket_of, format_ranges

    plant(tmp_path, 6, status(done=6))
    (tmp_path / "run.json").write_text('{"buckets": 4}')
    ids = [f"s{i}" for i in range(10)]  # the dataset; the index holds s0..s5
    st = extraction_status.ExtractionStatus(str(tmp_path), progress_window=60)
    st.read()
    before = st.read_buckets()
    done = {}
    for i in ids[:6]:
        done[str(bucket_of(i, 4))] = done.get(str(bucket_of(i, 4)), 0) + 1
    assert before["bucket_count"] == 4 and before["bucket_done"] == dict(sorted(done.items()))
    assert before["bucket_totals"] is None and before["finished_buckets"] == ""  # no totals: nothing finished
    totals = count_totals(ids, 4)
    write_bucket_totals(str(tmp_path), 4, "0-3", totals)
    after = st.read_buckets()
    finished = [b for b in range(4) if done.get(str(b), 0) >= totals[b]]
    assert after["bucket_totals"] == totals and after["assign"] == "0-3"
    assert after["finished_buckets"] == format_ranges(finished)
    (tmp_path / "run.json").write_text("{}")  # a run made before buckets
    assert st.read_buckets()["bucket_count"] is None


def test_an_unreadable_index_reports_its_buckets_unknown_never_none_started(tmp_path):
    """#39 review 5: a rebalance must not read "nothing started" from a host whose index it could
    not read (bucket_done {} with a bucket count), nor a takeover "nothing finished" as an answer."""
    plant(tmp_path, 3, status(done=3))
    (tmp_path / "run.json").write_text('{"buckets": 4}')
    os.replace(tmp_path / INDEX_NAME, tmp_path / "index.real")
    os.symlink(tmp_path / "index.real", tmp_path / INDEX_NAME)  # never followed: unreadable
    st = extraction_status.ExtractionStatus(str(tmp_path), progress_window=60)
    assert "unreadable index" in st.read()["message"]
    got = st.read_buckets()
    assert got["bucket_count"] is None and got["bucket_done"] == {} and got["finished_buckets"] == ""
    assert "unreadable index" in got["buckets_error"]
    os.unlink(tmp_path / INDEX_NAME)
    os.replace(tmp_path / "index.real", tmp_path / INDEX_NAME)
    st.read()
    fine = st.read_buckets()
    assert fine["bucket_count"] == 4 and fine["buckets_error"] is None and sum(fine["bucket_done"].values()) == 3


def test_the_runs_dataset_hash_comes_with_its_buckets(tmp_path):
    """#51: fleet-status compares the hosts' copies of the dataset: each host reports run.json's
    dataset_hash beside its per-bucket counts (None where run.json has none, or it is not a string)."""
    plant(tmp_path, 2, status(done=2))
    (tmp_path / "run.json").write_text('{"buckets": 4, "dataset_hash": "ab12"}')
    st = extraction_status.ExtractionStatus(str(tmp_path), progress_window=60)
    st.read()
    assert st.read_buckets()["dataset_hash"] == "ab12"
    (tmp_path / "run.json").write_text('{"buckets": 4, "dataset_hash": ["x"]}')
    assert st.read_buckets()["dataset_hash"] is None
    (tmp_path / "run.json").write_text('{"buckets": 4}')
    assert st.read_buckets()["dataset_hash"] is None
