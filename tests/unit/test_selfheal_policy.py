"""Self-healing's brakes (extraction/selfheal/policy.py) and its ledger (ledger.py): the circuit breaker
for correlated failures, flapping, failures in a row, resume, and a ledger that cannot be read."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from extraction.selfheal import ledger as ledger_mod
from extraction.selfheal import policy as pol
from extraction.selfheal import promtext

P = pol.Policy()  # defaults: > 25% and >= 2 nodes within 30 min; 3 failed; flap 3 in 24 h; 3 in a row
T = 1_000_000.0


def state(**kw) -> dict:
    s = ledger_mod.empty()
    s.update(kw)
    return s


def req(host: str, at: float, alert: str = "HsxSelfHealStalled", finding: str | None = None) -> dict:
    r = {"at": at, "host": host, "remedy": "recover", "alert": alert}
    if finding:
        r["finding"] = finding
    return r


def out(host: str, at: float, outcome: str, remedy: str = "recover", cause: str = "") -> dict:
    return {"at": at, "host": host, "remedy": remedy, "outcome": outcome, "cause": cause}


def test_one_node_failing_is_healed_but_a_storm_opens_the_breaker() -> None:
    s = state(requests=[req("n1", T)])
    assert pol.decide(s, P, T + 60, "n1", 8).act
    s["requests"].append(req("n2", T + 10))
    assert pol.decide(s, P, T + 60, "n2", 8).act  # 2 of 8 = 25%: not more than the share
    s["requests"].append(req("n3", T + 20))
    d = pol.decide(s, P, T + 60, "n3", 8)
    assert not d.act and d.open_breaker and d.open_breaker["hosts"] == ["n1", "n2", "n3"]
    assert "3 of 8 extraction nodes asked for a remedy within 30 min" in d.why
    s["breaker"] = d.open_breaker
    for host in ("n1", "n4"):  # once open, it holds every remedy, the first hosts' too
        later = pol.decide(s, P, T + 3600 * 24, host, 8)
        assert not later.act and "circuit breaker is open" in later.why


def test_a_small_fleet_needs_two_nodes_and_old_requests_fall_out_of_the_window() -> None:
    s = state(requests=[req("n1", T)])
    assert pol.decide(s, P, T + 1, "n1", 3).act  # 1 of 3 is over 25%, but not 2 nodes
    s["requests"].append(req("n2", T + 5))
    assert pol.decide(s, P, T + 6, "n2", 3).open_breaker
    s = state(requests=[req("n1", T), req("n2", T + P.window_s + 1)])
    assert pol.decide(s, P, T + P.window_s + 2, "n2", 3).act


def test_failed_remedies_fleet_wide_open_the_breaker() -> None:
    s = state(outcomes=[out("n1", T, "failed"), out("n2", T + 1, "failed")], requests=[req("n9", T + 2)])
    assert pol.decide(s, P, T + 3, "n9", 100).act
    s["outcomes"].append(out("n3", T + 2, "failed", remedy="takeover"))
    d = pol.decide(s, P, T + 3, "n9", 100)
    assert d.open_breaker and "3 automatic remedies failed within 30 min (limit 3) on n1, n2, n3" in d.why


def test_a_flapping_host_goes_to_a_person_even_when_each_recovery_succeeded() -> None:
    s = state(outcomes=[out("n1", T + i, "ok") for i in range(3)], requests=[req("n1", T + 10)])
    d = pol.decide(s, P, T + 11, "n1", 100)
    assert not d.act and "recovered automatically 3 times within 24 h (limit 3): flapping" in d.hold_host
    assert pol.decide(s, P, T + 11, "n2", 100).act  # the others are not held
    assert pol.decide(s, P, T + P.flap_window_s + 5, "n1", 100).act  # older than the window: forgotten
    s["host_resumed_at"] = {"n1": T + 5}  # a person re-armed it: counted from then
    assert pol.decide(s, P, T + 11, "n1", 100).act


def test_failures_in_a_row_hold_the_host_and_a_success_resets_them() -> None:
    fails = [out("n1", T + i, "failed", cause="unreachable") for i in range(3)]
    assert "last 3 automatic recoveries failed" in pol.host_hold(state(outcomes=fails), P, T + 9, "n1", flapping=False)
    mixed = [fails[0], fails[1], out("n1", T + 3, "ok"), out("n1", T + 4, "failed")]
    assert pol.host_hold(state(outcomes=mixed), pol.Policy(flap_max=10), T + 9, "n1") is None
    held = state(held={"n1": {"since": T, "why": "flapping"}})
    assert pol.decide(held, P, T + 1, "n1", 100).why == "n1 is held for a person: flapping"


def test_resume_starts_the_windows_and_lets_the_acknowledged_hosts_be_healed_once() -> None:
    s = state(requests=[req(h, T + i) for i, h in enumerate(("n1", "n2", "n3"))])
    assert pol.decide(s, P, T + 5, "n1", 3).open_breaker
    # The person fixed the storage and resumed: the same hosts' alerts, still firing, come again.
    s.update(resumed_at=T + 100, acknowledged=["n1", "n2", "n3"])
    s["requests"] += [req(h, T + 110 + i) for i, h in enumerate(("n1", "n2", "n3"))]
    assert all(pol.decide(s, P, T + 120, h, 3).act for h in ("n1", "n2", "n3"))
    s["requests"] += [req("n4", T + 130), req("n5", T + 131)]  # a new storm of other hosts opens it again
    assert pol.decide(s, P, T + 132, "n4", 5).open_breaker


def test_a_takeover_needs_the_rest_of_the_fleet_answering() -> None:
    s = state(requests=[{"at": T, "host": "n1", "remedy": "takeover", "alert": "HsxSelfHealNodeDown"}])
    assert pol.decide(s, P, T + 1, "n1", 4, unanswering=["n1"]).act
    d = pol.decide(s, P, T + 1, "n1", 4, unanswering=["n1", "n2"])
    assert d.open_breaker and d.open_breaker["cause"] == "unreachable" and "2 of 4 extraction nodes do not answer" in d.why


def test_the_common_cause_comes_from_verified_findings_only() -> None:
    s = state(requests=[req("n1", T, finding="storage: read-only file system"), req("n2", T, finding="storage: full"),
                        req("n3", T, finding="confirmed: job not progressing")])
    assert pol.decide(s, P, T + 1, "n3", 3).open_breaker["cause"] == "storage"
    s["requests"][1]["finding"] = "confirmed: job failed"  # 1 of 3 is no common cause
    del s["requests"][2]["finding"]
    assert pol.decide(s, P, T + 1, "n3", 3).open_breaker["cause"] == "unknown"
    s = state(requests=[req(h, T, alert="HsxSelfHealNodeDown") for h in ("n1", "n2", "n3")])
    assert pol.decide(s, P, T + 1, "n3", 3).open_breaker["cause"] == "unknown"
    # A verification that could not run saw nothing: it neither names nor outvotes a cause.
    s = state(requests=[req("n1", T, finding="storage: [Errno 5] Input/output error"),
                        req("n2", T, finding="unverified: the verification play wrote no result")])
    assert pol.decide(s, P, T + 1, "n2", 2).open_breaker["cause"] == "storage"
    s["requests"][0]["finding"] = "unverified: it stopped answering"
    assert pol.decide(s, P, T + 1, "n2", 2).open_breaker["cause"] == "unknown"


def test_bad_settings_are_refused() -> None:
    for bad in ({"share": 1.0}, {"share": -0.1}, {"min_nodes": 0}, {"window_s": 0}, {"flap_max": 0}):
        with pytest.raises(ValueError):
            pol.Policy(**bad)


def test_the_ledger_survives_a_restart_and_concurrent_writers(tmp_path: Path) -> None:
    d = tmp_path / "state"
    led = ledger_mod.Ledger(d)

    def add(i: int) -> None:
        with led.locked(T) as s:
            s["requests"].append(req(f"n{i}", T))

    threads = [threading.Thread(target=add, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r["host"] for r in ledger_mod.Ledger(d).read()["requests"]) == sorted(f"n{i}" for i in range(16))
    assert oct(os.stat(d).st_mode & 0o777) == "0o700"


def test_a_ledger_that_cannot_be_read_is_an_error_never_an_empty_ledger(tmp_path: Path) -> None:
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    (d / "ledger.json").write_text("{not json")
    with pytest.raises(ledger_mod.LedgerError, match="ledger.json: not JSON"):
        ledger_mod.Ledger(d).read()
    (d / "ledger.json").write_text(json.dumps({"version": 1, "requests": [{"host": "n1"}]}))
    with pytest.raises(ledger_mod.LedgerError, match=r"requests\[0\] is not an entry"):
        ledger_mod.Ledger(d).read()
    (d / "ledger.json").unlink()
    (d / "ledger.json").symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text(json.dumps(ledger_mod.empty()))
    with pytest.raises(ledger_mod.LedgerError, match="cannot read"):
        ledger_mod.Ledger(d).read()
    os.chmod(d, 0o777)
    with pytest.raises(ledger_mod.LedgerError, match="writable by no one else"), ledger_mod.Ledger(d).locked(T):
        pass


def test_the_metrics_say_the_breaker_and_the_held_hosts(tmp_path: Path) -> None:
    s = state(breaker={"opened_at": T, "why": "3 of 3", "cause": "storage", "hosts": ["n1", "n2"], "alerts": ["A"]},
              held={"n9": {"since": T, "why": 'flap "x"'}})
    promtext.write(tmp_path, s, T)
    text = (tmp_path / promtext.FILENAME).read_text()
    assert 'hsx_selfheal_breaker_open{cause="storage",hosts="n1,n2",alerts="A",why="3 of 3"} 1' in text
    assert 'hsx_selfheal_host_held{hsx_host="n9",why="flap \\"x\\""} 1' in text
    assert oct((tmp_path / promtext.FILENAME).stat().st_mode & 0o777) == "0o644"
    assert "hsx_selfheal_breaker_open 0" in promtext.render(ledger_mod.empty(), T)


def test_a_long_free_text_label_is_clipped_before_it_is_escaped() -> None:
    """A why/cause is flattened to one line and clipped to 300 characters, then escaped: a clip
    after escaping could cut an escape in two and leave the label's closing quote escaped."""
    from prometheus_client.parser import text_string_to_metric_families

    why = "two\nlines " + "x" * 289 + '"' + "past the clip"  # the quote is the 300th character
    text = promtext.render(state(breaker={"opened_at": T, "why": why, "cause": "a\\b", "hosts": [], "alerts": []}), T)
    (sample,) = next(f for f in text_string_to_metric_families(text) if f.name == "hsx_selfheal_breaker_open").samples
    assert sample.labels["why"] == "two lines " + "x" * 289 + '"' and sample.labels["cause"] == "a\\b"
    odd = 'h"o\\s\nt'  # what escape_label (fleetbuckets' host labels too) must give back as it was
    (family,) = text_string_to_metric_families(f'm{{host="{promtext.escape_label(odd)}"}} 1\n')
    assert family.samples[0].labels["host"] == odd


def test_a_host_the_loop_took_over_is_not_acted_on_again() -> None:
    s = state(requests=[{"at": T, "host": "n1", "remedy": "takeover", "alert": "HsxSelfHealNodeDown"}],
              retired={"n1": T - 10})
    d = pol.decide(s, P, T + 1, "n1", 8)
    assert not d.act and "was taken over" in d.why and "hsx selfheal resume --host n1" in d.why
    assert 'hsx_selfheal_host_retired{hsx_host="n1"} 1' in promtext.render(s, T)
    assert pol.decide(s, P, T + 1, "n2", 8).act


def test_the_verifications_findings() -> None:
    from extraction.selfheal.verify import judge

    base = {"claim": "recover", "host": "n1", "answers": True, "storage": {"probed": True, "writable": True}}
    alive = {"state": "running", "done": 7, "making_progress": True, "pid_alive": True, "status_age_s": 3, "uptime_s": 900}
    assert judge(base | {"status": alive}).category == "not-confirmed"  # a forged or stale alert: nothing runs
    # The same status from before the boot (its pid reused since): no job of this boot runs.
    assert "predates the host's boot" in judge(base | {"status": alive | {"status_age_s": 950}}).finding
    assert judge(base | {"status": alive | {"making_progress": False}}).category == "confirmed"
    # A finished run: nothing to recover (the alert came from another output's stale metrics).
    done = alive | {"state": "done", "done": 256, "total": 256, "making_progress": False, "pid_alive": False}
    assert judge(base | {"status": done}).finding == "not-confirmed: n1's job is done (256 of 256): nothing to recover"
    ro = base | {"status": alive, "storage": {"probed": True, "writable": False, "error": "Read-only file system"}}
    assert judge(ro).finding == "storage: the output on n1 is not writable: Read-only file system"
    # Storage that answers with I/O errors fails the status read too: the probe names the cause.
    eio = {"probed": True, "writable": False, "error": "[Errno 5] Input/output error"}
    assert judge(base | {"error": "status.json: [Errno 5] Input/output error", "storage": eio}).category == "storage"
    assert judge(base | {"error": "status.json: unreadable"}).category == "unverified"
    # It answered the ping, then not: its status was never read - never taken for "not progressing".
    assert "was not read" in judge(base | {"status_read": False, "status": {}}).finding
    # A full disk: creating the probe's empty file still works; the job's own reading says why it stopped.
    full = {"state": "paused: disk low", "done": 7, "making_progress": False, "pid_alive": False,
            "msg": "disk low on /data: 8388608 bytes free", "status_age_s": 40, "uptime_s": 900}
    assert judge(base | {"status": full}).finding == ("storage: the output on n1 is full (its job paused: "
                                                       "disk low on /data: 8388608 bytes free)")
    assert judge(base | {"answers": False}).category == "unreachable"
    down = {"claim": "takeover", "host": "n1", "answers": False, "exporter_up": False, "nodes": ["n1", "n2", "n3"],
            "answering": ["n2"]}
    v = judge(down)
    assert v.category == "unreachable" and v.unanswering == ["n1", "n3"]
    assert judge(down | {"exporter_up": True}).category == "not-confirmed"
    assert judge(down | {"answers": True}).category == "not-confirmed"


def test_a_failed_recoverys_stage_is_read_from_its_report(tmp_path: Path) -> None:
    from extraction.selfheal.remedy import _report_stage

    (tmp_path / "20261207T000000Z").mkdir()
    (tmp_path / "20261207T000000Z" / "n1.json").write_text(json.dumps({"host": "n1", "ok": False, "failed_step": "storage"}))
    assert _report_stage(str(tmp_path), "n1", 0) == "storage"
    assert _report_stage(str(tmp_path), "n1", time.time() + 60) is None  # written before the remedy started
    assert _report_stage(str(tmp_path), "n2", 0) is None
