"""Issue #39 review items 4 and 7: hsx.fleetplan.plan_takeover of a host already taken over (retired).

It kept only the buckets its own output had finished. A second takeover changes nothing while that
is still so, whatever else the inventory holds (a new host waiting for its rebalance); when it is
not (its disk died, or it cannot be reached: nothing of it counts finished), those kept buckets move
to the live hosts too, so they are never lost for good.
"""

from __future__ import annotations

import pytest

from hsx.buckets import AssignError, check_assignment
from hsx.fleetplan import plan_takeover

# n2 taken over: it kept 4 (finished on its own disk), 5-7 went to n1 and n3.
RETIRED = {"buckets": 12, "created": "x", "epoch": 1, "hosts": {"n1": "0-3,5-6", "n2": "4", "n3": "7-11"},
           "retired": ["n2"], "history": [{"epoch": 1, "action": "takeover", "host": "n2"}]}


def test_a_retired_host_whose_kept_buckets_still_read_finished_changes_nothing() -> None:
    new, moves = plan_takeover(RETIRED, "n2", {4}, ["n1", "n3"], "t")
    assert new is RETIRED and moves == {}


def test_rerunning_a_takeover_with_a_new_host_in_the_inventory_changes_nothing() -> None:
    """n4 is in the inventory, not yet rebalanced in: a rerun for the retired n2 is no error."""
    new, moves = plan_takeover(RETIRED, "n2", {4}, ["n1", "n3", "n4"], "t")
    assert new is RETIRED and moves == {}
    with pytest.raises(AssignError, match="live host.s. n4 are not in the assignment"):
        plan_takeover(RETIRED, "n1", set(), ["n3", "n4"], "t")  # a live host taken over: still refused


@pytest.mark.parametrize("finished", [set(), {0, 1}], ids=["unreachable", "its-disk-lost-bucket-4"])
def test_a_retired_hosts_kept_buckets_move_when_no_longer_read_finished(finished) -> None:
    new, moves = plan_takeover(RETIRED, "n2", finished, ["n1", "n3"], "t2")
    assert moves == {"n1": {4}}
    assert new["hosts"] == {"n1": "0-6", "n2": "", "n3": "7-11"} and new["retired"] == ["n2"]
    assert new["epoch"] == 2 and new["history"][-1] == {
        "epoch": 2, "at": "t2", "action": "takeover", "host": "n2", "kept": "", "moved": {"n1": "4"}}
    check_assignment(new["hosts"], 12)
    assert RETIRED["hosts"]["n2"] == "4"  # the input is not changed
