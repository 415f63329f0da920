"""Issue #51 item 7 and #50 item 5: library/hsx_assignment.py records what the hosts that answered
reported finished (O(reported), beside the assignment: finished.json), parks an unreachable host's
recorded finished buckets on a takeover (O(disk_lost) and O(park_window) release them), fails on a
record it cannot believe, and shows its change as a diff (--diff)."""

from __future__ import annotations

import json

import pytest
from ansible.module_utils.testing import patch_module_args
from ansible_modules import load_module

mod = load_module("hsx_assignment")
HOSTS = ["n1", "n2", "n3"]
AT = "2026-12-07T10:00:00+00:00"


def run_module(capsys, **args) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        mod.main()
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def fleet(capsys, tmp_path):
    path = tmp_path / ".fleet" / "assignment.json"
    run_module(capsys, path=str(path), hosts=HOSTS, buckets=12)  # n1 0-3, n2 4-7, n3 8-11
    record = path.parent / "finished.json"
    record.write_text(json.dumps({"version": 1, "buckets": 12, "hosts": {
        "n2": {"finished": "4-5", "at": AT, "by": "fleet-status"}}}))
    return path, record


def takeover(**more) -> dict:
    return dict(hosts=HOSTS, buckets=12, takeover="n2", live_hosts=["n1", "n3"], **more)


def test_an_unreachable_host_parks_what_it_last_reported_and_the_answers_are_recorded(capsys, fleet) -> None:
    path, record = fleet
    check = run_module(capsys, path=str(path), **takeover(reported={"n1": "0", "n3": ""}), _ansible_check_mode=True)
    assert check["moved"] == {"n1": "6", "n3": "7"} and check["parked"] == {"n2": "4-5"}
    assert json.loads(path.read_text())["epoch"] == 0 and "n1" not in record.read_text()  # check: nothing written
    r = run_module(capsys, path=str(path), **takeover(reported={"n1": "0", "n3": ""}))
    assert r["changed"] and r["assignment"] == {"n1": "0-3,6", "n2": "4-5", "n3": "7-11"}
    on_disk = json.loads(path.read_text())
    assert on_disk["parked"]["n2"]["buckets"] == "4-5" and on_disk["parked"]["n2"]["reported_at"] == AT
    rec = json.loads(record.read_text())["hosts"]
    assert rec["n1"]["finished"] == "0" and rec["n1"]["by"] == "takeover" and rec["n2"]["at"] == AT
    again = run_module(capsys, path=str(path), **takeover(reported={"n1": "0-3", "n3": ""}))
    assert not again["changed"] and json.loads(path.read_text()) == on_disk
    lost = run_module(capsys, path=str(path), **takeover(reported={"n1": "0-3", "n3": ""}, disk_lost=True))
    assert lost["changed"] and lost["moved"] == {"n1": "4", "n3": "5"} and lost["parked"] == {}
    assert lost["assignment"]["n2"] == "" and "parked" not in json.loads(path.read_text())


def test_past_the_park_window_a_takeover_redoes_them(capsys, fleet) -> None:
    path, _ = fleet
    run_module(capsys, path=str(path), **takeover(reported={}))
    data = json.loads(path.read_text())
    data["parked"]["n2"]["since"] = "2026-01-01T00:00:00+00:00"
    path.write_text(json.dumps(data))
    r = run_module(capsys, path=str(path), **takeover(reported={}, park_window=3600))
    assert r["changed"] and r["moved"] == {"n1": "4", "n3": "5"} and r["parked"] == {}


def test_a_record_it_cannot_believe_fails_the_takeover_naming_it(capsys, fleet) -> None:
    path, record = fleet
    record.write_text('{"version": 1, "buckets": 12, "hosts": {"n2": {"finished": "4-99", "at": "x"}}}')
    r = run_module(capsys, path=str(path), **takeover(reported={}))
    assert r["failed"] and str(record) in r["msg"] and "host 'n2'" in r["msg"]
    assert json.loads(path.read_text())["epoch"] == 0


def test_a_rebalance_records_the_answers(capsys, fleet) -> None:
    path, record = fleet
    r = run_module(capsys, path=str(path), hosts=HOSTS, buckets=12, rebalance=True, started="0-11",
                   answered=HOSTS, reported={"n1": "0-3", "n2": "4-7", "n3": "8"})
    assert not r["changed"]
    rec = json.loads(record.read_text())["hosts"]
    assert rec["n2"]["finished"] == "4-7" and rec["n2"]["by"] == "rebalance"


def test_diff_shows_the_file_before_and_after(capsys, fleet) -> None:
    path, _ = fleet
    r = run_module(capsys, path=str(path), **takeover(reported={}), _ansible_diff=True)
    diff = r["diff"]
    assert diff["before_header"] == diff["after_header"] == str(path)
    assert json.loads(diff["before"])["epoch"] == 0 and json.loads(diff["after"])["epoch"] == 1
    assert diff["after"] == path.read_text()
    new = tmp = path.parent / "new.json"
    made = run_module(capsys, path=str(tmp), hosts=HOSTS, buckets=12, _ansible_diff=True)
    assert made["diff"]["before"] == "" and made["diff"]["after"] == new.read_text()
    same = run_module(capsys, path=str(path), hosts=HOSTS, buckets=12, _ansible_diff=True)
    assert not same["changed"] and "diff" not in same
