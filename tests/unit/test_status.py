"""`hsx status`: one output for a person or as JSON, several summed, and whether the pid lives."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

from extraction.cli import main
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
    assert main(["status", *(str(tmp_path / n) for n in "abc")]) == 0
    text = capsys.readouterr().out
    assert "NOT running" in text and "crashed or killed" in text
    assert "TOTAL over 3 outputs: done 15/33" in text
    assert main(["status", *(str(tmp_path / n) for n in "abc"), "--json"]) == 0
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
