"""Issue #39 item 2: library/hsx_assignment.py, the fleet's one assignment file on the control node."""

from __future__ import annotations

import json
import os

import pytest
from ansible.module_utils.testing import patch_module_args
from ansible_modules import load_module

mod = load_module("hsx_assignment")


def run_module(capsys, **args) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        mod.main()
    return json.loads(capsys.readouterr().out)


def test_made_on_first_use_then_read_as_it_is(capsys, tmp_path) -> None:
    path = tmp_path / "fleet" / "assignment.json"
    check = run_module(capsys, path=str(path), hosts=["n2", "n1"], buckets=8, _ansible_check_mode=True)
    assert check["changed"] and check["assignment"] == {"n1": "0-3", "n2": "4-7"} and not path.exists()
    r = run_module(capsys, path=str(path), hosts=["n2", "n1"], buckets=8)
    assert r["changed"] and r["assignment"] == {"n1": "0-3", "n2": "4-7"}
    on_disk = json.loads(path.read_text())
    assert on_disk == {"buckets": 8, "created": r["created"], "epoch": 0, "hosts": {"n1": "0-3", "n2": "4-7"},
                       "retired": [], "history": []}
    assert path.read_text().startswith('{\n  "buckets": 8,')  # pretty: one field a line
    # A person edits it (moves bucket 3): read as it is, never derived again.
    path.write_text(json.dumps({**on_disk, "hosts": {"n1": "0-2", "n2": "3-7"}}))
    again = run_module(capsys, path=str(path), hosts=["n1", "n2"], buckets=8)
    assert not again["changed"] and again["assignment"] == {"n1": "0-2", "n2": "3-7"}
    # No temp left; the lock beside it (hsx.assignfile.assignment_lock) stays.
    assert sorted(p.name for p in path.parent.iterdir()) == ["assignment.json", "assignment.json.lock"]


def test_a_changed_host_list_is_reported_saying_which_hosts(capsys, tmp_path) -> None:
    path = tmp_path / "a.json"
    run_module(capsys, path=str(path), hosts=["n1", "n2", "n3"], buckets=9)
    before = path.read_bytes()
    r = run_module(capsys, path=str(path), hosts=["n1", "n2", "n3", "n4"], buckets=9)
    assert r["failed"] and "host(s) n4 are not in the assignment" in r["msg"]
    assert "-e hsx_rebalance=true" in r["msg"] and "--check first" in r["msg"]
    r = run_module(capsys, path=str(path), hosts=["n1", "n3"], buckets=9)
    assert not r.get("failed") and r["gone_hosts"] == ["n2"] and r["assignment"]["n2"] == "3-5"
    assert "host(s) n2 of the assignment are not in this play" in json.dumps(r["warnings"])
    r = run_module(capsys, path=str(path), hosts=["n1", "n2", "n3"], buckets=1024)
    assert r["failed"] and "the assignment has 9 buckets, the play asks for 1024" in r["msg"]
    assert path.read_bytes() == before


def test_never_made_from_part_of_the_fleet(capsys, tmp_path) -> None:
    path = tmp_path / "fleet" / "a.json"
    r = run_module(capsys, path=str(path), hosts=["new-node"], buckets=8, create=False)
    assert r["failed"] and "this play runs on part of the fleet (--limit)" in r["msg"] and not path.exists()
    assert "Run the play once without --limit" in r["msg"]
    run_module(capsys, path=str(path), hosts=["a", "b"], buckets=8)
    r = run_module(capsys, path=str(path), hosts=["a"], buckets=8, create=False)  # made: read as usual
    assert not r.get("failed") and r["assignment"] == {"a": "0-3", "b": "4-7"}


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"{", "not valid JSON"),
        (b"[]", "not an assignment"),
        (b'{"buckets": 4, "hosts": {"a": "0-1", "b": "1-3"}}', "bucket 1 is on both a and b"),
        (b'{"buckets": 4, "hosts": {"a": "0-1"}}', "bucket(s) 2-3 are on no host"),
        (b'{"buckets": "4", "hosts": {"a": "0-3"}}', "the bucket count must be an integer"),
    ],
)
def test_a_bad_file_fails_naming_it_and_is_left_alone(capsys, tmp_path, content, says) -> None:
    path = tmp_path / "a.json"
    path.write_bytes(content)
    r = run_module(capsys, path=str(path), hosts=["a", "b"], buckets=4)
    assert r["failed"] and str(path) in r["msg"] and says in r["msg"] and "move it aside" in r["msg"]
    assert path.read_bytes() == content


def test_no_link_or_fifo_is_followed(capsys, tmp_path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("x")
    (tmp_path / "link.json").symlink_to(secret)
    r = run_module(capsys, path=str(tmp_path / "link.json"), hosts=["a"], buckets=4)
    assert r["failed"] and "link.json" in r["msg"] and secret.read_text() == "x"
    os.mkfifo(tmp_path / "fifo.json")
    r = run_module(capsys, path=str(tmp_path / "fifo.json"), hosts=["a"], buckets=4)  # never waits on it
    assert r["failed"] and "not a regular file" in r["msg"]


def test_ansible_doc_renders(module_doc) -> None:
    doc = module_doc("hsx_assignment")["doc"]
    assert {"path", "hosts", "buckets"} <= set(doc["options"])
    assert doc["attributes"]["platform"]["platforms"] == "posix"  # from the doc fragment



def test_a_takeover_moves_the_unfinished_buckets_and_a_second_changes_nothing(capsys, tmp_path) -> None:
    path = tmp_path / "a.json"
    run_module(capsys, path=str(path), hosts=["n1", "n2", "n3"], buckets=12)  # n1 0-3, n2 4-7, n3 8-11
    before = path.read_bytes()
    args = dict(path=str(path), hosts=["n1", "n2", "n3"], buckets=12, takeover="n2", live_hosts=["n1", "n3"])
    check = run_module(capsys, **args, finished="4", _ansible_check_mode=True)
    assert check["changed"] and check["moved"] == {"n1": "5-6", "n3": "7"} and path.read_bytes() == before
    r = run_module(capsys, **args, finished="4")
    assert r["changed"] and r["assignment"] == {"n1": "0-3,5-6", "n2": "4", "n3": "7-11"}
    on_disk = json.loads(path.read_text())
    assert on_disk["epoch"] == 1 and on_disk["retired"] == ["n2"]
    assert on_disk["history"][0] | {"at": "-"} == {
        "epoch": 1, "at": "-", "action": "takeover", "host": "n2", "kept": "4", "moved": {"n1": "5-6", "n3": "7"}}
    again = run_module(capsys, **args, finished="4")  # what it kept still reads finished
    assert not again["changed"] and again["moved"] == {} and json.loads(path.read_text()) == on_disk
    r = run_module(capsys, **{**args, "takeover": "n9"})
    assert r["failed"] and "n9 is not in the assignment" in r["msg"]
    r = run_module(capsys, **{**args, "takeover": "n1", "live_hosts": []})
    assert r["failed"] and "no live host to take n1's" in r["msg"] and json.loads(path.read_text()) == on_disk


def test_a_rebalance_moves_only_unstarted_buckets_to_the_new_host(capsys, tmp_path) -> None:
    path = tmp_path / "a.json"
    run_module(capsys, path=str(path), hosts=["n1", "n2"], buckets=8)  # n1 0-3, n2 4-7
    args = dict(path=str(path), hosts=["n1", "n2", "n3"], buckets=8, rebalance=True, started="0-2,4-7")
    check = run_module(capsys, **args, _ansible_check_mode=True)
    assert check["changed"] and check["moved"] == {"n3": "3"} and json.loads(path.read_text())["epoch"] == 0
    r = run_module(capsys, **args)
    assert r["assignment"] == {"n1": "0-2", "n2": "4-7", "n3": "3"} and r["epoch"] == 1
    again = run_module(capsys, **args)
    assert not again["changed"] and again["assignment"] == r["assignment"]
    r = run_module(capsys, **{**args, "hosts": ["n1", "n2", "n3", "n4"], "answered": ["n1", "n3", "n4"]})
    assert r["failed"] and "host(s) n2 did not answer" in r["msg"]
