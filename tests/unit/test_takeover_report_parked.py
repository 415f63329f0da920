"""Issue #51 item 7: the takeover's report says which buckets stay parked on the host taken over (it did
not answer: what it last reported finished), not that they are finished on its disk."""

from __future__ import annotations

from extraction.fleet.takeoverreport import takeover_check, takeover_lines

PLAN = {"changed": True, "epoch": 1, "moved": {"n1": "6", "n3": "7"}, "parked": {"n2": "4-5"},
        "assignment": {"n1": "0-3,6", "n2": "4-5", "n3": "7-11"}}


def facts(host: str) -> dict:
    return {"host": host, "mode": "run", "status_before": {"unreachable": True},
            "takeover": {"host": "n2", "plan": PLAN, "in_inventory": True, "unit_unreachable": True}}


def test_the_report_says_what_is_parked() -> None:
    ok, detail = takeover_check(facts("n2"))
    assert ok and "keeps 4-5 parked" in detail and "--disk-lost" in detail
    lines = takeover_lines([{"mode": "run", "after": facts("n2")}])
    assert "n2 keeps 4-5 parked" in lines[-1] and lines[-1].startswith("Moved n2's unfinished buckets: n1 takes 6")
