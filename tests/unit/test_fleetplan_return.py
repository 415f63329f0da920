"""Issue #51 item 5 (low): a taken-over node that comes back is returned into the fleet by a rebalance.

recover.yml starts no job of a retired host (not even with the finished buckets it kept); the README
says how to bring it back: `hsx recover -e hsx_rebalance=true` (--check first). The rebalance
un-retires the retired hosts of the play whose outputs were read, and gives them, as a new host, an
even share of the buckets no node has started; what they kept stays theirs. Without
hsx_rebalance=true, or while its output could not be read, a retired host stays retired.
"""

from __future__ import annotations

import json

import pytest
from ansible.module_utils.testing import patch_module_args
from ansible_modules import load_module

from hsx.buckets import check_assignment
from hsx.fleetplan import plan_rebalance

mod = load_module("hsx_assignment")
# n2 taken over: it kept 4 (finished), 5-7 went to n1 and n3.
RETIRED = {"buckets": 12, "created": "x", "epoch": 1, "hosts": {"n1": "0-3,5-6", "n2": "4", "n3": "7-11"},
           "retired": ["n2"], "history": [{"epoch": 1, "action": "takeover", "host": "n2"}]}


def run_module(capsys, **args) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        mod.main()
    return json.loads(capsys.readouterr().out)


def test_a_returning_host_gets_an_even_share_of_unstarted_buckets_and_keeps_what_it_kept() -> None:
    new, gets = plan_rebalance(RETIRED, [], {0, 1, 4, 5, 7, 8}, "t", returning=["n2"])
    assert new["retired"] == [] and new["epoch"] == 2
    # 12 // 3 = 4 a host: n1 gives its 2 highest unstarted beyond 4 (6, 3), n3 its 1 (11).
    assert gets == {"n2": {3, 6, 11}}
    assert new["hosts"] == {"n1": "0-2,5", "n2": "3-4,6,11", "n3": "7-10"}
    check_assignment(new["hosts"], 12, "x")
    assert new["history"][-1] | {"at": "-"} == {"epoch": 2, "at": "-", "action": "rebalance", "added": [],
                                                "returned": ["n2"], "moved": {"n2": "3,6,11"}}
    assert RETIRED["retired"] == ["n2"]  # its input unchanged


def test_the_module_returns_a_retired_host_only_on_a_rebalance_that_read_it(capsys, tmp_path) -> None:
    path = tmp_path / "a.json"
    path.write_text(json.dumps(RETIRED))
    args = dict(path=str(path), hosts=["n1", "n2", "n3"], buckets=12)
    r = run_module(capsys, **args)  # a recovery: n2 stays retired
    assert not r["changed"] and r["retired"] == ["n2"]
    r = run_module(capsys, **args, rebalance=True, started="0-1,4-5,7-8", answered=["n1", "n3"])
    assert not r["changed"] and r["retired"] == ["n2"]  # its output unread: it stays out
    r = run_module(capsys, **args, rebalance=True, started="0-1,4-5,7-8", _ansible_check_mode=True)
    assert r["changed"] and r["moved"] == {"n2": "3,6,11"} and json.loads(path.read_text()) == RETIRED
    r = run_module(capsys, **args, rebalance=True, started="0-1,4-5,7-8")
    assert r["changed"] and r["retired"] == [] and r["assignment"]["n2"] == "3-4,6,11"
    assert json.loads(path.read_text())["retired"] == []
