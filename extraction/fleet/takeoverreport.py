"""A takeover's part of the report (playbooks/takeover.yml; roles/recover_report `takeover` dumps the facts).

Each host's facts carry `takeover`: the plan (`plan`: epoch, moved, the new assignment, changed),
whether the host is in the inventory, and for the host taken over what its retire tasks read and
did (`unit`, `unit_unreachable`, `unit_read`, `stopped`); `status_before` is what its own output
read (finished buckets, or unreachable). Contract:
- `takeover_check(facts)`: (ok, detail) of the host's `takeover` check, or None without takeover
  facts. The host taken over is ok whatever its reachability (a dead host is what a takeover is
  for); a taker is ok (its job's own check says how its restart went); a host that did not answer
  took nothing and is not ok (it needs a look).
- `takeover_lines(reports)`: the summary's "## Takeover" section (what moved where, what the host
  taken over kept (parked: it did not answer, what it last reported finished), what became of its
  job), [] when no report carries a takeover.
"""

from __future__ import annotations

from typing import Any


def _answered(read: Any) -> bool:
    return isinstance(read, dict) and not read.get("unreachable") and not read.get("failed") \
        and read.get("buckets_error") is None


def _job_of_taken(facts: dict[str, Any], t: dict[str, Any]) -> str:
    host, check = facts.get("host"), facts.get("mode") == "check"
    if not t.get("in_inventory"):
        return "not in the inventory: nothing reached (retire it there for good: it holds no bucket to run)"
    if t.get("unit_unreachable") or (not t.get("unit_read") and not _answered(facts.get("status_before"))):
        return (f"unreachable: its job could not be stopped (a fleet member's job does not start at boot, and "
                f"recover.yml does not start a retired host's; if it was only cut off and runs on, run "
                f"hsx takeover {host} again once it answers)")
    unit = t.get("unit") or {}
    if t.get("stopped"):
        return "job would be stopped and disabled at boot" if check else "job stopped, not enabled at boot"
    if unit.get("LoadState") == "loaded":
        return f"job not running ({unit.get('ActiveState', '?')}), not enabled at boot"
    return "no job unit"


def takeover_check(facts: dict[str, Any]) -> tuple[bool, str] | None:
    """The host's `takeover` check (see the module's contract)."""
    t = facts.get("takeover")
    if not isinstance(t, dict):
        return None
    host, plan = facts.get("host"), t.get("plan") if isinstance(t.get("plan"), dict) else {}
    moved = plan.get("moved") if isinstance(plan.get("moved"), dict) else {}
    owns = (plan.get("assignment") or {}).get(host) if isinstance(plan.get("assignment"), dict) else None
    if not plan or plan.get("failed"):
        return False, f"no plan: {plan.get('msg') or 'the plan was not made'}"
    if host == t.get("host"):
        parked = (plan.get("parked") or {}).get(host) if isinstance(plan.get("parked"), dict) else None
        keeps = (f"keeps {owns} parked (it did not answer: what it last reported finished; redone only with "
                 f"hsx takeover {host} --disk-lost or after the park window)" if parked else
                 f"keeps {owns} (finished on its own disk)" if owns else "keeps no bucket")
        return True, f"taken over; {keeps}; {_job_of_taken(facts, t)}"
    if host in moved:
        return True, f"takes {moved[host]} (owns {owns} now); its job resumes with them"
    read = facts.get("status_before")
    if not _answered(read):
        why = (read or {}).get("buckets_error") or (read or {}).get("msg") or "unreachable"
        return False, f"did not answer ({why}): took nothing"
    return True, f"takes nothing (owns {owns or 'nothing'})"


def takeover_lines(reports: list[dict[str, Any]]) -> list[str]:
    """The summary's takeover section (see the module's contract)."""
    t = next((r["after"]["takeover"] for r in reports if (r.get("after") or {}).get("takeover")), None)
    if not t:
        return []
    plan, host = t.get("plan") or {}, t.get("host")
    if not plan or plan.get("failed"):
        return ["", "## Takeover", "", f"{host}: nothing moved, no plan was made: {plan.get('msg') or '?'}"]
    moved, epoch = plan.get("moved") or {}, plan.get("epoch")
    kept = (plan.get("assignment") or {}).get(host) or "nothing"
    if (plan.get("parked") or {}).get(host):
        kept += " parked (it did not answer: what it last reported finished)"
    if moved:
        verb = "Would move" if reports[0].get("mode") == "check" else "Moved"
        text = (f"{verb} {host}'s unfinished buckets: "
                + "; ".join(f"{h} takes {r}" for h, r in sorted(moved.items()))
                + f" ({host} keeps {kept}; epoch {epoch}).")
    else:
        text = f"Nothing to move: {host} is already taken over (epoch {epoch}; it keeps {kept})."
    return ["", "## Takeover", "", text]
