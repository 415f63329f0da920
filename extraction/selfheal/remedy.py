"""One automatic remedy, as the self-healing rulebook asks for it (extensions/eda/playbooks/selfheal_remedy.yml
runs `hsx selfheal remedy`): record the request, let a storm show itself, verify the alert's claim, apply
the brakes (hsx.selfheal policy), and only then run recover.yml or playbooks/takeover.yml in place (a
checkout's, with its ansible.cfg when it has one; without --project-dir, the installed collection's
hsx.recovery.recover or hsx.recovery.takeover by FQCN, with the operator's own Ansible configuration) -
then record the outcome, which may open the breaker or hold the host.

    record request -> settle (default 60 s) -> held at once if nothing may run whatever a verification finds
        (breaker open, host held or taken over: no SSH to a sick fleet for each repeated alert)
        -> verify (extensions/eda/playbooks/selfheal_verify.yml) -> decide
        -> act (the remedy playbook)  -> record its outcome (ok / failed, its failed stage)
        -> or hold (breaker open, host held, claim not confirmed, verification failed): nothing runs

Every step is written to the ledger before the next one starts, under its lock, so remedies of
several hosts running at once see each other, and a restart forgets nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from extraction.selfheal import ledger as ledger_mod
from extraction.selfheal import policy as pol
from extraction.selfheal import promtext
from extraction.selfheal.verify import Verification, verify

# The remedy playbooks: from a checkout (paths in --project-dir), or from the installed collection
# hsx.recovery (by FQCN: ansible-playbook finds them in the collections path; no checkout, no ansible.cfg).
REMEDY_PLAYBOOKS = {"recover": "recover.yml", "takeover": "playbooks/takeover.yml"}
INSTALLED_PLAYBOOKS = {"recover": "hsx.recovery.recover", "takeover": "hsx.recovery.takeover"}
VERIFY_PLAYBOOK = "extensions/eda/playbooks/selfheal_verify.yml"  # in a checkout
# A recovery that failed at its canary: the node computes other states than its shards hold. Held at once
# (the remedy alerts also leave it out once Prometheus reads hsx_recover_canary_mismatch, but an alert
# repeated before that scrape would run the same refused recovery again).
CANARY_HOLD = ("its recovery's canary found it computing other states than its shards hold (HsxCanaryMismatch): "
               "find why, run recover.yml --limit HOST, then hsx selfheal resume --host HOST")
INSTALLED_VERIFY_PLAYBOOK = "hsx.recovery.selfheal_verify"
_FQCN = re.compile(r"^[A-Za-z_]\w*\.[A-Za-z_]\w*\.[A-Za-z_]\w*$")


@dataclass(frozen=True)
class Request:
    host: str
    remedy: str  # recover | takeover
    alert: str
    project_dir: Path | None  # a checkout; None: the installed collection (playbooks by FQCN)
    inventories: list[str]
    playbook: str  # a FQCN, or a path (relative to project_dir)
    report_dir: str
    max_failures: int  # the node-side guard of recover.yml (playbooks/shared/selfheal_guard.yml)
    settle_s: float
    state_dir: Path
    textfile_dir: str | None
    verify: bool = True
    exporter_port: int = 9100
    progress_window_s: int = 120  # a job that made progress this recently, alive, is left alone


def log(msg: str) -> None:
    print(f"hsx selfheal: {msg}", flush=True)


def _bin(name: str) -> str:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else name


def is_fqcn(playbook: str) -> bool:
    """`ns.collection.name`: a collection's playbook, which ansible-playbook resolves itself."""
    return bool(_FQCN.match(playbook))


def playbook_arg(project_dir: Path | None, playbook: str) -> str:
    """What ansible-playbook is given: a FQCN as it is, a path relative to the checkout (or as given)."""
    return playbook if is_fqcn(playbook) or project_dir is None else str(project_dir / playbook)


def verify_playbook(project_dir: Path | None) -> str:
    """The verification play: the checkout's when it has one, else the installed collection's."""
    if project_dir is not None and (project_dir / VERIFY_PLAYBOOK).is_file():
        return str(project_dir / VERIFY_PLAYBOOK)
    return INSTALLED_VERIFY_PLAYBOOK


def _env(req: Request) -> dict[str, str]:
    """The playbooks' environment: a checkout's ansible.cfg when it has one (its roles_path, library, ...);
    otherwise the operator's own Ansible configuration, as for any installed collection."""
    env = dict(os.environ)
    if req.project_dir is not None and (req.project_dir / "ansible.cfg").is_file():
        env["ANSIBLE_CONFIG"] = str(req.project_dir / "ansible.cfg")
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


def extraction_nodes(req: Request) -> list[str]:
    """The hosts of the group extraction_nodes in the real inventory (ansible-inventory)."""
    argv = [_bin("ansible-inventory"), *[a for inv in req.inventories for a in ("-i", inv)], "--list"]
    run = subprocess.run(argv, cwd=req.project_dir, env=_env(req), capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise ValueError(f"ansible-inventory failed on {':'.join(req.inventories)}: {run.stderr.strip()[-500:]}")
    inv = json.loads(run.stdout)

    def hosts(group: str, seen: set[str]) -> set[str]:
        if group in seen:
            return set()
        seen.add(group)
        g = inv.get(group) or {}
        out = set(g.get("hosts") or [])
        for child in g.get("children") or []:
            out |= hosts(child, seen)
        return out

    return sorted(hosts("extraction_nodes", set()))


def _report_stage(report_dir: str, host: str, since: float) -> str | None:
    """The failed stage in the newest per-host report written since `since` (recover.yml's report)."""
    newest = None
    for p in Path(report_dir).glob(f"*/{host}.json"):
        try:
            if p.stat().st_mtime >= since and (newest is None or p.stat().st_mtime > newest.stat().st_mtime):
                newest = p
        except OSError:
            continue
    if newest is None:
        return None
    try:
        data = json.loads(newest.read_text())
    except (OSError, ValueError):
        return None
    stage = data.get("failed_step")  # extraction/fleet/report.py: the stage a failed host stopped at
    return stage if isinstance(stage, str) else None


@contextlib.contextmanager
def remedy_locks(state_dir: Path, remedy: str, host: str) -> Iterator[None]:
    """One remedy at a time per host, and a takeover alone in the fleet: a takeover re-renders and
    restarts the jobs of every live host, so it holds the fleet lock exclusively; a recovery holds it
    shared and its host's lock exclusively (always in that order: no deadlock). Kept in the state
    directory, so they hold across rulebooks and by-hand runs of `hsx selfheal remedy`."""
    fds = []
    try:
        for name, mode in (("fleet.lock", fcntl.LOCK_EX if remedy == "takeover" else fcntl.LOCK_SH),
                           (f"host-{host}.lock", fcntl.LOCK_EX)):
            if remedy == "takeover" and name != "fleet.lock":
                continue
            fd = os.open(state_dir / name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            fds.append(fd)
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                log(f"waiting for {'the fleet' if name == 'fleet.lock' else host}: another remedy is running")
                fcntl.flock(fd, mode)
        yield
    finally:
        for fd in reversed(fds):
            os.close(fd)


def run(req: Request, policy: pol.Policy) -> int:
    """0: acted and the remedy succeeded, or held (nothing run: said why); 1: acted and it failed;
    2: the request is not one to act on (not an extraction node) or the ledger cannot be used."""
    ledger = ledger_mod.Ledger(req.state_dir, keep_s=max(policy.window_s, policy.flap_window_s) * 2)
    try:
        nodes = extraction_nodes(req)
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        log(f"cannot read the inventory, nothing run: {exc}")
        return 2
    if req.host not in nodes:
        log(f"{req.host!r} is not a host of the group extraction_nodes in {':'.join(req.inventories)}: nothing run")
        return 2
    rid = uuid.uuid4().hex
    now = time.time()
    with ledger.locked(now) as state:
        state["textfile_dir"] = req.textfile_dir
        state["requests"].append({"id": rid, "at": now, "host": req.host, "remedy": req.remedy, "alert": req.alert})
        promtext.write(req.textfile_dir, state, now)
    log(f"{req.remedy} of {req.host} asked by {req.alert}; settling {req.settle_s:g} s")
    time.sleep(req.settle_s)
    with remedy_locks(req.state_dir, req.remedy, req.host):
        return _verify_decide_act(req, policy, ledger, rid, nodes)


def _verify_decide_act(req: Request, policy: pol.Policy, ledger: ledger_mod.Ledger, rid: str, nodes: list[str]) -> int:
    if req.verify and _held_unverified(req, policy, ledger, nodes):
        return 0
    check = (verify(req.project_dir, req.inventories, req.host, req.remedy, env=_env(req),
                    playbook=verify_playbook(req.project_dir),
                    exporter_port=req.exporter_port, progress_window_s=req.progress_window_s) if req.verify
             else Verification(f"{pol.FINDING_CONFIRMED}: not verified (verification off)"))
    log(f"verification: {check.finding}")
    now = time.time()
    with ledger.locked(now) as state:
        for r in state["requests"]:
            if r.get("id") == rid:
                r["finding"] = check.finding
        decision = pol.decide(state, policy, now, req.host, len(nodes), check.unanswering)
        if decision.open_breaker:
            state["breaker"] = decision.open_breaker
        if decision.hold_host:
            state["held"][req.host] = {"since": now, "why": decision.hold_host}
        act, outcome, why = decision.act, pol.OUTCOME_HELD, decision.why
        if act and check.category == pol.FINDING_NOT_CONFIRMED:
            act, outcome, why = False, pol.OUTCOME_NOT_CONFIRMED, f"the alert's claim does not hold: {check.finding}"
        elif act and check.category == pol.FINDING_UNVERIFIED:
            act, why = False, f"the claim could not be verified, holding: {check.finding}"
        elif act and req.remedy == "recover" and check.category == pol.FINDING_UNREACHABLE:
            # The recovery cannot reach the host: a failed automatic recovery, counted here on the control node.
            act, outcome, why = False, pol.OUTCOME_FAILED, f"not run: {check.finding}"
        if not act:
            _record_outcome(state, policy, now, req, len(nodes), outcome, check.category, why)
        if state.get("breaker"):
            b = state["breaker"]
            b["cause"] = pol.common_cause(state, b.get("hosts", []), b["opened_at"] - policy.window_s) \
                if b.get("cause", "unknown") == "unknown" else b["cause"]
        promtext.write(req.textfile_dir, state, now)
    if not act:
        log(f"HELD: nothing run on {req.host}: {why}" if outcome != pol.OUTCOME_FAILED else f"FAILED: {why}")
        return 1 if outcome == pol.OUTCOME_FAILED else 0

    started = time.time()
    rc = _run_playbook(req)
    now = time.time()
    stage = _report_stage(req.report_dir, req.host, started) if rc else None
    with ledger.locked(now) as state:
        if rc == 0 and req.remedy == "takeover":
            state["retired"][req.host] = now  # its alerts act no more (the rules read hsx_selfheal_host_retired)
        if stage == "canary":  # it computes differently now: no automatic retry, whatever the alerts say
            state["held"][req.host] = {"since": now, "why": CANARY_HOLD}
            log(f"{req.host} is now held for a person: {CANARY_HOLD}")
        _record_outcome(state, policy, now, req, len(nodes), pol.OUTCOME_OK if rc == 0 else pol.OUTCOME_FAILED,
                        stage or "", f"{req.playbook} rc {rc}")
        promtext.write(req.textfile_dir, state, now)
    result = "ok" if rc == 0 else f"failed (rc {rc}, stage {stage or 'unknown'})"
    log(f"{req.playbook} for {req.host}: {result}")
    return 0 if rc == 0 else 1


def _held_unverified(req: Request, policy: pol.Policy, ledger: ledger_mod.Ledger, nodes: list[str]) -> bool:
    """Held without a verification when nothing may run on the host whatever it would find (the breaker
    already open, the host taken over or held): a storm's repeated alerts then cost the sick fleet no SSH
    session each. Recorded as any hold is, with no finding (it saw nothing: it names no common cause)."""
    now = time.time()
    with ledger.locked(now) as state:
        early = pol.decide(state, policy, now, req.host, len(nodes))
        if early.act or early.open_breaker:
            return False  # the verification decides (and may name the cause of a breaker it opens)
        if early.hold_host:
            state["held"][req.host] = {"since": now, "why": early.hold_host}
        _record_outcome(state, policy, now, req, len(nodes), pol.OUTCOME_HELD, "", f"not verified: {early.why}")
        promtext.write(req.textfile_dir, state, now)
    log(f"HELD: nothing run on {req.host} (not verified: nothing may run whatever it finds): {early.why}")
    return True


def _record_outcome(state: dict, policy: pol.Policy, now: float, req: Request, fleet: int,
                    outcome: str, cause: str, detail: str) -> None:
    """Every outcome - acted (ok, failed) or held - goes into the ledger the same way, then may open the
    breaker or hold the host."""
    state["outcomes"].append({"at": now, "host": req.host, "remedy": req.remedy, "outcome": outcome,
                              "cause": cause, "detail": detail})
    _after_outcome(state, policy, now, req.host, fleet)


def _after_outcome(state: dict, policy: pol.Policy, now: float, host: str, fleet: int) -> None:
    """An outcome may open the breaker (failures fleet-wide) or hold the host (flapping, in a row)."""
    if not state.get("breaker"):
        opened = pol.breaker_check(state, policy, now, fleet)
        if opened:
            state["breaker"] = opened
            log(f"circuit breaker opened: {opened['why']}")
    if host not in state["held"]:
        why = pol.host_hold(state, policy, now, host, flapping=False)
        if why:
            state["held"][host] = {"since": now, "why": why}
            log(f"{host} is now held for a person: {why}")


def _run_playbook(req: Request) -> int:
    extra = {"hsx_selfheal": True, "hsx_report_dir": req.report_dir, "hsx_selfheal_max_failures": req.max_failures}
    host_args = ["-e", json.dumps({"hsx_takeover_host": req.host})] if req.remedy == "takeover" else ["--limit", req.host]
    argv = [_bin("ansible-playbook"), playbook_arg(req.project_dir, req.playbook),
            *[a for inv in req.inventories for a in ("-i", inv)], *host_args, "-e", json.dumps(extra)]
    log("running " + " ".join(argv))
    return subprocess.run(argv, cwd=req.project_dir, env=_env(req)).returncode
