"""When self-healing may act, and when it must hold and ask a person: pure decisions over the ledger.

The rules (README, "Self-healing"; docs/security.md), each a setting of `Policy`:

- **Circuit breaker** (fleet-wide; NVIDIA NVSentinel stops mass remediation the same way): it opens
  when more than `share` of the extraction nodes, and at least `min_nodes`, asked for a remedy within
  `window_s` - or when they are observed not answering (a takeover's verification) - or when
  `max_failed` automatic remedies failed fleet-wide within `window_s`. An open breaker holds every
  remedy until a person resumes (`hsx selfheal resume`); a correlated failure (shared storage full, a
  rack's power, a partition between the control node and the fleet) looks exactly like this, and
  remedies one node at a time cannot fix it.
- **Flapping**: a host recovered automatically `flap_max` times within `flap_window_s` (each may have
  succeeded) is held for a person.
- **Failures in a row**: `max_failures` failed automatic remedies of a host in a row - counted on the
  control node, so a recovery that never reached the host (SSH refused, host key changed) counts too -
  hold the host for a person.

Windows start at the last resume: a person's `resume` closes the breaker and acknowledges the hosts
that were in it (their alerts, still firing, may now be acted on, once each), and `resume --host`
re-arms one host. Nothing here reads a clock or a file: `now` and the state are given.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

# A request's finding after verification (remedy.py): the first word is its category.
FINDING_CONFIRMED = "confirmed"  # the alert's claim holds: act
FINDING_NOT_CONFIRMED = "not-confirmed"  # the claim does not hold (the job makes progress, the node answers)
FINDING_UNREACHABLE = "unreachable"  # the control node cannot reach the host
FINDING_STORAGE = "storage"  # the host's output storage is unwritable or full
FINDING_UNVERIFIED = "unverified"  # the verification itself could not run

OUTCOME_OK = "ok"
OUTCOME_FAILED = "failed"  # acted, and the remedy failed (or could not reach the host)
OUTCOME_HELD = "held"  # not acted: the breaker or the host's hold
OUTCOME_NOT_CONFIRMED = "not-confirmed"  # not acted: the alert's claim did not hold
ACTED = (OUTCOME_OK, OUTCOME_FAILED)


@dataclass(frozen=True)
class Policy:
    share: float = 0.25
    min_nodes: int = 2
    window_s: float = 1800.0
    max_failed: int = 3
    flap_max: int = 3
    flap_window_s: float = 86400.0
    max_failures: int = 3

    def __post_init__(self) -> None:
        if not 0 <= self.share < 1:
            raise ValueError(f"share must be in [0, 1), not {self.share}")
        for name in ("min_nodes", "max_failed", "flap_max", "max_failures"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.window_s <= 0 or self.flap_window_s <= 0:
            raise ValueError("windows must be positive")

    def too_many(self, nodes: int, fleet: int) -> bool:
        """More than `share` of `fleet`, and at least `min_nodes`."""
        return nodes >= self.min_nodes and nodes > self.share * fleet


@dataclass(frozen=True)
class Decision:
    act: bool
    why: str
    open_breaker: dict[str, Any] | None = None  # the breaker to record as opened now
    hold_host: str | None = None  # why the host is now held for a person


def _since(state: dict[str, Any], now: float, window: float, host: str | None = None) -> float:
    start = max(now - window, float(state.get("resumed_at") or 0))
    if host is not None:
        start = max(start, float(state.get("host_resumed_at", {}).get(host) or 0))
    return start


def alerting_hosts(state: dict[str, Any], policy: Policy, now: float) -> list[str]:
    """The distinct hosts that asked for a remedy within the window since the last resume, less the
    hosts a person acknowledged when resuming (within one window after it)."""
    since = _since(state, now, policy.window_s)
    acknowledged = set(state.get("acknowledged") or []) if now < float(state.get("resumed_at") or 0) + policy.window_s else set()
    return sorted({r["host"] for r in state.get("requests", []) if r["at"] >= since and r["host"] not in acknowledged})


def failed_remedies(state: dict[str, Any], policy: Policy, now: float) -> list[dict[str, Any]]:
    since = _since(state, now, policy.window_s)
    return [o for o in state.get("outcomes", []) if o["at"] >= since and o["outcome"] == OUTCOME_FAILED]


def common_cause(state: dict[str, Any], hosts: list[str], since: float) -> str:
    """The category most of these hosts' latest findings share ("storage", "unreachable"), else
    "unknown": a strict majority of the verified findings, and at least half of the hosts. Only a verified
    observation names a cause: an alert's name alone does not, nor does a verification that could not run
    (it saw nothing: it neither names nor outvotes one)."""
    latest: dict[str, str] = {}
    for r in state.get("requests", []):
        if r["host"] in hosts and r["at"] >= since and r.get("finding"):
            latest[r["host"]] = r["finding"].split(":", 1)[0]
    for o in state.get("outcomes", []):
        if o["host"] in hosts and o["at"] >= since and o.get("cause"):
            latest[o["host"]] = o["cause"]
    latest = {h: c for h, c in latest.items() if c != FINDING_UNVERIFIED}
    if not latest:
        return "unknown"
    cause, n = Counter(latest.values()).most_common(1)[0]
    named = cause in (FINDING_STORAGE, FINDING_UNREACHABLE) and n * 2 > len(latest) and n * 2 >= len(hosts)
    return cause if named else "unknown"


def _breaker(state: dict[str, Any], policy: Policy, now: float, why: str, hosts: list[str]) -> dict[str, Any]:
    since = _since(state, now, policy.window_s)
    alerts = sorted({r.get("alert") or "?" for r in state.get("requests", []) if r["host"] in hosts and r["at"] >= since})
    return {"opened_at": now, "why": why, "hosts": hosts, "alerts": alerts,
            "cause": common_cause(state, hosts, since)}


def breaker_check(state: dict[str, Any], policy: Policy, now: float, fleet: int,
                  unanswering: list[str] | None = None) -> dict[str, Any] | None:
    """The breaker to open now, or None. `unanswering`: the hosts a verification saw not answering."""
    minutes = f"{policy.window_s / 60:g} min"
    hosts = alerting_hosts(state, policy, now)
    if policy.too_many(len(hosts), fleet):
        return _breaker(state, policy, now, f"{len(hosts)} of {fleet} extraction nodes asked for a remedy within "
                        f"{minutes}: {', '.join(hosts)}", hosts)
    if unanswering and policy.too_many(len(unanswering), fleet):
        b = _breaker(state, policy, now, f"{len(unanswering)} of {fleet} extraction nodes do not answer the control "
                     f"node: {', '.join(sorted(unanswering))}", sorted(unanswering))
        return dict(b, cause=FINDING_UNREACHABLE)
    failed = failed_remedies(state, policy, now)
    if len(failed) >= policy.max_failed:
        fhosts = sorted({o["host"] for o in failed})
        return _breaker(state, policy, now, f"{len(failed)} automatic remedies failed within {minutes} "
                        f"(limit {policy.max_failed}) on {', '.join(fhosts)}", fhosts)
    return None


def host_hold(state: dict[str, Any], policy: Policy, now: float, host: str, *, flapping: bool = True) -> str | None:
    """Why `host` must now be left to a person, or None. `flapping=False`: only the failures in a row
    (after an outcome; flapping is judged when the next request comes: "more than flap_max")."""
    held = state.get("held", {}).get(host)
    if held:
        return held["why"]
    acted = [o for o in state.get("outcomes", []) if o["host"] == host and o["outcome"] in ACTED
             and o.get("remedy") == "recover" and o["at"] >= _since(state, now, policy.flap_window_s, host)]
    if flapping and len(acted) >= policy.flap_max:
        return (f"recovered automatically {len(acted)} times within {policy.flap_window_s / 3600:g} h "
                f"(limit {policy.flap_max}): flapping")
    in_a_row = 0
    for o in reversed(acted):
        if o["outcome"] != OUTCOME_FAILED:
            break
        in_a_row += 1
    if in_a_row >= policy.max_failures:
        return f"its last {in_a_row} automatic recoveries failed (limit {policy.max_failures})"
    return None


def decide(state: dict[str, Any], policy: Policy, now: float, host: str, fleet: int,
           unanswering: list[str] | None = None) -> Decision:
    """May self-healing act on `host` now? (The request itself is already in `state`.)"""
    breaker = state.get("breaker")
    if breaker:
        return Decision(False, f"the circuit breaker is open since {breaker['opened_at']:.0f}: {breaker['why']}")
    opened = breaker_check(state, policy, now, fleet, unanswering)
    if opened:
        return Decision(False, f"circuit breaker opened: {opened['why']}", open_breaker=opened)
    if host in state.get("retired", {}):
        return Decision(False, f"{host} was taken over (its work moved to the others): nothing more is done for it; "
                        f"return it with a rebalance, then `hsx selfheal resume --host {host}`")
    why = host_hold(state, policy, now, host)
    if why:
        return Decision(False, f"{host} is held for a person: {why}", hold_host=why)
    return Decision(True, "no brake applies")
