"""`hsx status`: one output for a person or as JSON, several summed, and whether the pid lives."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

from extraction.cli import build_parser, main
from extraction.commands.status import STATUS_EXIT_CODES
from hsx.exitcodes import EXIT_CRASHED, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PAUSED, EXIT_USAGE
from hsx.status import StatusReporter, pid_alive, read_status


def _status(out: Path, done: int, total: int, state: str = "running", pid: int | None = None, **kw) -> None:
    out.mkdir(parents=True, exist_ok=True)
    r = StatusReporter(str(out), total=total, skipped_existing=done, reserve_bytes=10)
    r.set_state(state)
    data = r.write()
    data.update({"samples_per_s": 2.0, "pid": pid if pid is not None else os.getpid(), **kw})
    (out / "status.json").write_text(json.dumps(data))


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_pid_alive() -> None:
    assert pid_alive(os.getpid(), socket.gethostname()) is True
    assert pid_alive(_dead_pid(), socket.gethostname()) is False
    assert pid_alive(os.getpid(), "some-other-host") is None


def test_one_output_human_and_json(tmp_path: Path, capsys) -> None:
    _status(tmp_path / "a", 5, 20)
    assert main(["status", str(tmp_path / "a")]) == 0
    text = capsys.readouterr().out
    assert "running" in text and "done 5/20 (25.0%)" in text and "alive" in text
    assert main(["status", str(tmp_path / "a"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (one,) = data["outputs"]
    assert one["pid_alive"] is True and one["done"] == 5 and data["total"]["total"] == 20


def test_dead_run_flagged_and_several_summed(tmp_path: Path, capsys) -> None:
    _status(tmp_path / "a", 5, 20)
    _status(tmp_path / "b", 7, 10, pid=_dead_pid())
    _status(tmp_path / "c", 3, 3, state="done")
    assert main(["status", *(str(tmp_path / n) for n in "abc")]) == EXIT_CRASHED
    text = capsys.readouterr().out
    assert "NOT running" in text and "crashed or killed" in text
    assert "TOTAL over 3 outputs: done 15/33" in text
    assert main(["status", *(str(tmp_path / n) for n in "abc"), "--json"]) == EXIT_CRASHED
    total = json.loads(capsys.readouterr().out)["total"]
    assert (total["done"], total["total"], total["outputs"]) == (15, 33, 3)
    assert total["samples_per_s"] == 4.0  # running outputs only


def test_missing_status_is_an_error(tmp_path: Path, capsys) -> None:
    assert main(["status", str(tmp_path)]) == 2
    assert "no status.json" in capsys.readouterr().err


def test_history_stays_bounded(tmp_path: Path) -> None:
    r = StatusReporter(str(tmp_path), total=10, skipped_existing=0, reserve_bytes=0)
    for _ in range(1000):
        r.snapshot()
    assert len(r.snapshot()["history"]) <= 241
    r.write()
    assert read_status(str(tmp_path))["history"]


def test_exit_code_says_what_state_the_run_is_in(tmp_path: Path, capsys) -> None:
    """Scripts and Ansible read the exit status: failed, crashed, paused and interrupted are not 0."""
    cases = {
        "running": (dict(state="running"), EXIT_OK),
        "done": (dict(state="done"), EXIT_OK),
        "other-host": (dict(state="running", pid=_dead_pid(), host="some-other-host"), EXIT_OK),
        "failed": (dict(state="failed"), EXIT_FAILED),
        "crashed": (dict(state="running", pid=_dead_pid()), EXIT_CRASHED),
        "paused": (dict(state="paused: disk low"), EXIT_PAUSED),
        "interrupted": (dict(state="interrupted"), EXIT_INTERRUPTED),
    }
    for name, (kw, want) in cases.items():
        state = kw.pop("state")
        _status(tmp_path / name, 1, 2, state=state, **kw)
        assert main(["status", str(tmp_path / name)]) == want, name
    text = capsys.readouterr().out
    assert "state crashed: the process is gone" in text
    # several outputs: the first code of the table's order that any of them has
    assert main(["status", str(tmp_path / "paused"), str(tmp_path / "crashed")]) == EXIT_CRASHED
    assert main(["status", str(tmp_path / "paused"), str(tmp_path / "nope")]) == EXIT_USAGE


def test_exit_codes_are_in_the_help() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    text = " ".join(sub.choices["status"].format_help().split())
    for code, _when, _meaning in STATUS_EXIT_CODES:
        assert f"{code} " in text
    assert "75 paused" in text and "3 crashed" in text


def test_status_follows_a_quarantine(tmp_path: Path, capsys) -> None:
    """`hsx verify --quarantine` marks bad and missing shards not done: `hsx status` says so after,
    not the old "done 3/3"."""
    from shard_helpers import make_run

    out = tmp_path / "out"
    writer, entries = make_run(out, n=3)
    writer.close()
    _status(out, 3, 3, state="done", pid=_dead_pid())
    (out / entries[0].path).write_bytes(b"not a shard")  # bad: quarantined
    (out / entries[1].path).unlink()  # missing
    assert main(["verify", str(out), "--quarantine"]) == EXIT_FAILED
    capsys.readouterr()
    assert main(["status", str(out)]) == EXIT_FAILED
    text = capsys.readouterr().out
    assert "done 1/3" in text, text
    assert "failed - hsx verify --quarantine marked 2 sample(s) not done" in text
    assert "run hsx extract again to redo them" in text
    assert main(["verify", str(out), "--quarantine"]) == EXIT_OK  # nothing more to mark: unchanged
    assert read_status(str(out))["done"] == 1


def test_status_says_the_nodes_split(tmp_path: Path, capsys) -> None:
    """Issue #39: the current assignment (or the legacy shard split) is said; none for a whole run."""
    _status(tmp_path / "a", 5, 20, buckets=1024, assign="0-255,512-767")
    _status(tmp_path / "b", 5, 20, buckets=1024, shard_index=1, num_shards=2)
    _status(tmp_path / "c", 5, 20, buckets=1024, assign=None, shard_index=0, num_shards=1)
    assert main(["status", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c")]) == 0
    a, b, c = capsys.readouterr().out.split(str(tmp_path))[1:4]
    assert "  split: buckets 0-255,512-767 of 1024 (this node's assignment)" in a
    assert "  split: shard 1 of 2 (--shard-index/--num-shards)" in b
    assert "split" not in c
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "status.json").write_text(json.dumps({"state": "running", "assign": 7}))
    assert main(["status", str(tmp_path / "d")]) == EXIT_USAGE
    assert "assign" in capsys.readouterr().err
