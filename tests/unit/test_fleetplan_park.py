"""Issue #51 item 7: a takeover of an unreachable host parks the buckets it last reported finished.

They stay its own (no taker redoes them; the fleet is not complete until its output is read again),
marked `parked` in the assignment; only its unfinished buckets move. They move too when the operator
says its disk is gone (disk_lost), or when a takeover runs after the park window; a host that
answers again is no longer parked (its output says what it finished). Every bucket stays on exactly
one host throughout (exactly-once).
"""

from __future__ import annotations

import pytest

from hsx.buckets import AssignError, check_assignment
from hsx.fleetplan import plan_rebalance, plan_takeover

FLEET = {"buckets": 12, "created": "x", "epoch": 0, "hosts": {"n1": "0-3", "n2": "4-7", "n3": "8-11"},
         "retired": [], "history": []}
REPORTED = {"finished": {4, 5, 9}, "at": "2026-12-07T10:00:00+00:00", "by": "fleet-status"}
T0, T1, LATE = "2026-12-07T11:00:00+00:00", "2026-12-07T12:00:00+00:00", "2026-12-09T11:00:01+00:00"
DAY = 86400


def test_an_unreachable_hosts_reported_buckets_are_parked_not_moved() -> None:
    new, moves = plan_takeover(FLEET, "n2", None, ["n1", "n3"], T0, recorded=REPORTED, park_window_s=DAY)
    assert moves == {"n1": {6}, "n3": {7}}  # only the unfinished ones; 9 is not n2's
    assert new["hosts"] == {"n1": "0-3,6", "n2": "4-5", "n3": "7-11"} and new["retired"] == ["n2"]
    assert new["parked"] == {"n2": {"buckets": "4-5", "since": T0, "reported_at": REPORTED["at"],
                                    "reported_by": "fleet-status", "window_s": DAY}}
    assert new["history"][-1]["parked"] == "4-5" and new["history"][-1]["kept"] == "4-5"
    check_assignment(new["hosts"], 12)
    assert "parked" not in FLEET


def test_without_a_record_an_unreachable_host_parks_nothing() -> None:
    new, moves = plan_takeover(FLEET, "n2", None, ["n1", "n3"], T0, recorded=None, park_window_s=DAY)
    assert moves == {"n1": {4, 5}, "n3": {6, 7}} and new["hosts"]["n2"] == "" and "parked" not in new


def test_a_second_takeover_within_the_window_changes_nothing() -> None:
    parked, _ = plan_takeover(FLEET, "n2", None, ["n1", "n3"], T0, recorded=REPORTED, park_window_s=DAY)
    again, moves = plan_takeover(parked, "n2", None, ["n1", "n3"], T1, recorded=REPORTED, park_window_s=DAY)
    assert again is parked and moves == {}


@pytest.mark.parametrize("how", ["disk_lost", "past_window"])
def test_parked_buckets_move_when_the_disk_is_lost_or_the_window_passed(how) -> None:
    parked, _ = plan_takeover(FLEET, "n2", None, ["n1", "n3"], T0, recorded=REPORTED, park_window_s=DAY)
    when, lost = (T1, True) if how == "disk_lost" else (LATE, False)
    new, moves = plan_takeover(parked, "n2", None, ["n1", "n3"], when, recorded=REPORTED, disk_lost=lost,
                               park_window_s=DAY)
    assert moves == {"n1": {4}, "n3": {5}} and new["hosts"]["n2"] == "" and "parked" not in new
    entry = new["history"][-1]
    assert entry["released"] == "4-5" and entry["why"] == ("disk lost" if lost else "unreachable past the park window")
    check_assignment(new["hosts"], 12)


def test_disk_lost_on_the_first_takeover_moves_everything() -> None:
    new, moves = plan_takeover(FLEET, "n2", None, ["n1", "n3"], T0, recorded=REPORTED, disk_lost=True,
                               park_window_s=DAY)
    assert moves == {"n1": {4, 5}, "n3": {6, 7}} and "parked" not in new


def test_a_parked_host_that_answers_keeps_what_its_output_finished_and_is_no_longer_parked() -> None:
    parked, _ = plan_takeover(FLEET, "n2", None, ["n1", "n3"], T0, recorded=REPORTED, park_window_s=DAY)
    new, moves = plan_takeover(parked, "n2", {4}, ["n1", "n3"], T1, recorded=REPORTED, park_window_s=DAY)
    assert moves == {"n1": {5}} and new["hosts"]["n2"] == "4" and "parked" not in new  # 5 was not there after all


def test_a_returning_host_is_no_longer_parked() -> None:
    parked, _ = plan_takeover(FLEET, "n2", None, ["n1", "n3"], T0, recorded=REPORTED, park_window_s=DAY)
    back, _ = plan_rebalance(parked, [], set(range(12)), T1, returning=["n2"])
    assert back["hosts"]["n2"] == "4-5" and "parked" not in back and back["retired"] == []


def test_a_bad_time_is_an_error() -> None:
    parked, _ = plan_takeover(FLEET, "n2", None, ["n1", "n3"], T0, recorded=REPORTED, park_window_s=DAY)
    parked["parked"]["n2"]["since"] = "yesterday"
    with pytest.raises(AssignError, match="parked since 'yesterday'"):
        plan_takeover(parked, "n2", None, ["n1", "n3"], T1, recorded=REPORTED, park_window_s=DAY)
