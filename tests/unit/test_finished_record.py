"""Issue #51 item 7: the control node's record of what each host last reported finished
(hsx.finishedrecord), and the assignment file's `parked` (hsx.assignfile): data the control node
wrote, still read as data - a record that cannot be believed is an error naming it, never "nothing
finished"; an assignment whose parked buckets are not a retired host's own is refused.
"""

from __future__ import annotations

import json
import os

import pytest

from hsx.assignfile import AssignmentFileError, read_assignment, write_assignment
from hsx.finishedrecord import FinishedRecordError, read_record, record_path, update_record

AT = "2026-12-07T10:00:00+00:00"


def test_no_file_is_nothing_recorded_and_updates_keep_other_hosts(tmp_path) -> None:
    path = record_path(str(tmp_path / ".fleet" / "assignment.json"))
    assert path == str(tmp_path / ".fleet" / "finished.json")
    assert read_record(path, 12) == {}
    update_record(path, 12, {"n1": {0, 1, 2}, "n2": {5}}, "fleet-status", AT)
    update_record(path, 12, {"n2": {5, 6}}, "takeover", "2026-12-07T11:00:00+00:00")
    assert read_record(path, 12) == {
        "n1": {"finished": {0, 1, 2}, "at": AT, "by": "fleet-status"},
        "n2": {"finished": {5, 6}, "at": "2026-12-07T11:00:00+00:00", "by": "takeover"},
    }
    assert json.loads(open(path).read())["hosts"]["n1"]["finished"] == "0-2"
    assert sorted(os.listdir(tmp_path / ".fleet")) == ["finished.json", "finished.json.lock"]  # no temp left


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"version": 1, "buckets": 8, "hosts": {}}', "recorded for 8 buckets, the assignment has 12"),
        (b'{"version": 1, "buckets": 12, "hosts": {"n1": {"finished": "0-99", "at": "' + AT.encode() + b'"}}}',
         "host 'n1'"),
        (b'{"version": 1, "buckets": 12, "hosts": {"n1": {"finished": "0", "at": "monday"}}}', "not ISO 8601"),
        (b'{"hosts": []}', "not a finished-buckets record"),
    ],
    ids=["not-json", "other-bucket-count", "bad-ranges", "bad-time", "not-a-record"],
)
def test_a_record_that_cannot_be_believed_is_an_error_naming_it(tmp_path, content, says) -> None:
    path = tmp_path / "finished.json"
    path.write_bytes(content)
    with pytest.raises(FinishedRecordError, match=says) as e:
        read_record(str(path), 12)
    assert str(path) in str(e.value)
    with pytest.raises(FinishedRecordError):  # and it is not overwritten
        update_record(str(path), 12, {"n1": {1}}, "fleet-status", AT)
    assert path.read_bytes() == content


def test_a_link_is_not_followed(tmp_path) -> None:
    (tmp_path / "elsewhere.json").write_text("{}")
    os.symlink(tmp_path / "elsewhere.json", tmp_path / "finished.json")
    with pytest.raises(FinishedRecordError, match="symlink"):
        read_record(str(tmp_path / "finished.json"), 12)


BASE = {"buckets": 12, "created": "x", "epoch": 1, "hosts": {"n1": "0-3,6", "n2": "4-5", "n3": "7-11"},
        "retired": ["n2"], "history": []}
PARK = {"buckets": "4-5", "since": AT, "reported_at": AT, "reported_by": "fleet-status"}


def test_the_assignment_keeps_parked_buckets(tmp_path) -> None:
    path = str(tmp_path / "assignment.json")
    write_assignment(path, {**BASE, "parked": {"n2": PARK}})
    assert read_assignment(path)["parked"] == {"n2": PARK}
    write_assignment(path, BASE)
    assert "parked" not in read_assignment(path)


@pytest.mark.parametrize(
    ("parked", "says"),
    [
        ({"n1": {**PARK, "buckets": "0"}}, "'n1', which is not retired"),
        ({"n2": {**PARK, "buckets": "4-6"}}, "bucket.s. 6 it does not own"),
        ({"n2": {"buckets": "4"}}, "needs buckets, since"),
        (["n2"], "must map hosts"),
    ],
    ids=["not-retired", "not-its-own", "incomplete", "not-a-map"],
)
def test_bad_parked_buckets_are_refused(tmp_path, parked, says) -> None:
    path = tmp_path / "assignment.json"
    path.write_text(json.dumps({**BASE, "parked": parked}))
    with pytest.raises(AssignmentFileError, match=says):
        read_assignment(str(path))
