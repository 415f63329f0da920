"""`hsx selfheal remedy` holds at once, with no verification, when nothing may run on the host whatever a
verification would find (the breaker already open, the host held or taken over): the repeated alerts of a
storm cost the sick fleet no SSH session each. Where the verification could change the decision (nothing
open yet: it may act, or open the breaker and name its cause), it still runs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from extraction.selfheal import ledger as ledger_mod
from extraction.selfheal import policy as pol
from extraction.selfheal import remedy
from extraction.selfheal.verify import Verification


def request(tmp: Path, host: str) -> remedy.Request:
    return remedy.Request(host=host, remedy="recover", alert="HsxSelfHealStalled", project_dir=None,
                          inventories=[], playbook="hsx.recovery.recover", report_dir=str(tmp / "reports"),
                          max_failures=3, settle_s=0, state_dir=tmp / "state", textfile_dir=None)


@pytest.fixture
def verified(monkeypatch) -> list[str]:
    """The hosts verify() was asked about; it answers 'not confirmed' (so nothing ever runs)."""
    asked: list[str] = []

    def fake_verify(project_dir, inventories, host, claim, **kw):
        asked.append(host)
        return Verification(f"{pol.FINDING_NOT_CONFIRMED}: the job makes progress")

    monkeypatch.setattr(remedy, "verify", fake_verify)
    monkeypatch.setattr(remedy, "_run_playbook", lambda req: pytest.fail("nothing may run here"))
    return asked


def new_ledger(tmp: Path) -> ledger_mod.Ledger:
    (tmp / "state").mkdir(mode=0o700)
    return ledger_mod.Ledger(tmp / "state")


def ledger_state(tmp: Path) -> dict:
    return json.loads((tmp / "state" / "ledger.json").read_text())


@pytest.mark.parametrize("brake", ["breaker", "held", "retired"])
def test_a_braked_host_is_held_without_a_verification(tmp_path, verified, brake) -> None:
    ledger = new_ledger(tmp_path)
    with ledger.locked(time.time()) as state:
        if brake == "breaker":
            state["breaker"] = {"opened_at": time.time(), "why": "3 automatic remedies failed", "cause": "storage",
                                "hosts": ["n1", "n2"], "alerts": []}
        elif brake == "held":
            state["held"]["n1"] = {"since": time.time(), "why": "recovered automatically 3 times: flapping"}
        else:
            state["retired"]["n1"] = time.time()
    assert remedy._verify_decide_act(request(tmp_path, "n1"), pol.Policy(), ledger, "r1", ["n1", "n2", "n3"]) == 0
    assert verified == []
    (outcome,) = ledger_state(tmp_path)["outcomes"]
    assert outcome["outcome"] == pol.OUTCOME_HELD and outcome["cause"] == ""
    assert outcome["detail"].startswith("not verified: "), outcome


def test_with_no_brake_the_claim_is_still_verified(tmp_path, verified) -> None:
    ledger = new_ledger(tmp_path)
    with ledger.locked(time.time()):
        pass
    assert remedy._verify_decide_act(request(tmp_path, "n1"), pol.Policy(), ledger, "r1", ["n1", "n2", "n3"]) == 0
    assert verified == ["n1"]
    (outcome,) = ledger_state(tmp_path)["outcomes"]
    assert outcome["outcome"] == pol.OUTCOME_NOT_CONFIRMED, outcome


def test_a_recovery_refused_by_its_canary_holds_the_host(tmp_path, monkeypatch) -> None:
    """A node that computes differently is never recovered again automatically: the next alert, even one
    Prometheus sent before it read the node's canary metric, is held without a verification."""
    asked: list[str] = []
    monkeypatch.setattr(remedy, "verify", lambda *a, **kw: asked.append("v") or Verification(
        f"{pol.FINDING_CONFIRMED}: the job is not making progress"))
    monkeypatch.setattr(remedy, "_run_playbook", lambda req: 2)
    monkeypatch.setattr(remedy, "_report_stage", lambda report_dir, host, since: "canary")
    ledger = new_ledger(tmp_path)
    with ledger.locked(time.time()):
        pass
    req = request(tmp_path, "n1")
    assert remedy._verify_decide_act(req, pol.Policy(), ledger, "r1", ["n1", "n2", "n3"]) == 1
    held = ledger_state(tmp_path)["held"]["n1"]
    assert "canary" in held["why"] and "resume --host" in held["why"], held
    monkeypatch.setattr(remedy, "_run_playbook", lambda req: pytest.fail("a refused node ran again"))
    assert remedy._verify_decide_act(req, pol.Policy(), ledger, "r2", ["n1", "n2", "n3"]) == 0
    assert asked == ["v"]
