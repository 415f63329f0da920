"""Issue #39 review item 2: the assignment file's read -> plan -> write is one step. Two takeovers at
once wait for each other (an flock on a sibling lock file, no link followed), and a write is refused
when the file changed since it was read (a writer that took no lock: a hand edit, an older hsx).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from ansible_modules import load_module

mod = load_module("hsx_assignment")  # its own copy of module_utils/hsx, as Ansible ships it
from ansible.module_utils.hsx.assignfile import (  # noqa: E402  (importable once load_module ran)
    AssignmentFileError,
    assignment_lock,
    read_assignment,
    write_assignment,
)

HOSTS = ["n1", "n2", "n3"]


def fleet(tmp_path: Path) -> Path:
    path = tmp_path / "fleet" / "assignment.json"
    mod.resolve(str(path), HOSTS, 12, check_mode=False)  # n1 0-3, n2 4-7, n3 8-11
    return path


def test_a_second_writer_waits_for_the_lock_then_plans_from_what_the_first_wrote(tmp_path) -> None:
    path = fleet(tmp_path)
    results: list[object] = []

    def take_n3() -> None:
        results.append(mod.takeover(str(path), "n3", "", ["n1", "n2"], False))

    with assignment_lock(str(path)):
        other = threading.Thread(target=take_n3)
        other.start()
        time.sleep(0.5)
        assert other.is_alive() and read_assignment(str(path))["epoch"] == 0  # waiting, nothing written
        # The first takeover, under the lock (as the module's would be): n2 over.
        new, _moves = mod.plan_takeover(read_assignment(str(path)), "n2", set(), ["n1", "n3"], "t")
        write_assignment(str(path), new)
    other.join(10)
    assert not other.is_alive() and results
    after = read_assignment(str(path))
    assert after["epoch"] == 2 and after["retired"] == ["n2", "n3"]  # both takeovers, none lost
    assert after["hosts"]["n2"] == after["hosts"]["n3"] == "" and after["hosts"]["n1"] == "0-11"
    assert (path.parent / "assignment.json.lock").is_file()


def test_a_write_is_refused_when_the_file_changed_since_it_was_read(tmp_path, monkeypatch) -> None:
    path = fleet(tmp_path)
    real_plan = mod.plan_takeover

    def plan_while_someone_edits(assignment, *args, **kwargs):  # another writer comes in between, taking no lock
        meanwhile, _ = real_plan(assignment, "n3", set(), ["n1", "n2"], "t")
        write_assignment(str(path), meanwhile)
        return real_plan(assignment, *args, **kwargs)

    monkeypatch.setattr(mod, "plan_takeover", plan_while_someone_edits)
    with pytest.raises(AssignmentFileError, match=r"changed since this play read it \(epoch 0 then, 1 now\).*rerun"):
        mod.takeover(str(path), "n2", "", ["n1", "n3"], False)
    assert read_assignment(str(path))["retired"] == ["n3"]  # the other writer's update stands


def test_the_lock_file_is_never_followed_and_check_mode_takes_no_lock(tmp_path) -> None:
    path = fleet(tmp_path)
    lock = path.parent / "assignment.json.lock"
    lock.unlink()
    mod.takeover(str(path), "n2", "", ["n1", "n3"], True)
    assert not lock.exists()
    target = tmp_path / "elsewhere"
    lock.symlink_to(target)
    with pytest.raises(AssignmentFileError, match="assignment.json.lock is a symlink"):
        mod.takeover(str(path), "n2", "", ["n1", "n3"], False)
    assert not target.exists() and json.loads(path.read_text())["epoch"] == 0
