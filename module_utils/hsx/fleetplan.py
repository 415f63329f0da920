"""Moving buckets between hosts: a takeover (a host's unfinished buckets to the live hosts) and a
rebalance (unstarted buckets to new hosts). Pure functions of the recorded assignment (hsx.assignfile)
and what the nodes reported; stdlib only.

Contract:
- `plan_takeover(assignment, host, finished, live, now)`: the new assignment. `host` keeps only the
  buckets of its own that `finished` names (what the nodes reported finished on it; nothing for a
  host that could not be reached) and is recorded in `retired`; the rest of its buckets go to
  `live` (sorted) in contiguous near-equal runs, the first hosts one more. `epoch` grows by one and
  `history` gets an entry saying what moved where. A host already retired keeps what `finished`
  still names of what it kept; while that is all of it the assignment comes back as it is (a
  second takeover changes nothing), checked before anything else (a live host the assignment
  does not name, waiting for its rebalance, is then no error). Kept buckets no longer read
  finished (its disk died; nothing counts finished on a host that cannot be reached) move like
  any unfinished ones, so they are never lost for good.
- Parking (issue #51): `finished` None means `host` did not answer. Then the buckets of its own
  that `recorded` (hsx.finishedrecord: what it last reported finished, read by fleet-status, a
  takeover or a rebalance while it answered) names are **parked**: it keeps them (no taker redoes
  them) and `parked[host]` says which, since when, which report (`reported_at`, `reported_by`) and
  for how long (`window_s`: `park_window_s` as the parking takeover had it, else DEFAULT_PARK_WINDOW_S);
  only its other buckets move. A second takeover while it still does not answer changes nothing,
  until the entry's `window_s` has passed since it was parked (one fact: the takeover that releases
  them, `hsx fleet-status`'s hsx_fleet_parked_window_seconds and the alert on it all read it there;
  an entry without one, `park_window_s`), or `disk_lost` (the operator says its disk is gone): then
  the parked buckets move like unfinished ones (`history`: released, why); nothing releases them
  while no takeover runs. A host that answers is never parked: it keeps what its own output
  finished (none with `disk_lost`). Its parked buckets are not done for the fleet until its output
  is read again (hsx fleet-status).
- `plan_rebalance(assignment, new_hosts, started, now, returning=())`: the new assignment with
  `new_hosts` added and the retired hosts of `returning` back (no longer retired; the buckets they
  kept stay theirs). Only buckets no node has started (not in `started`: any sample of it done on
  any host) move; each existing (not retired) host gives its highest unstarted buckets beyond an
  even share of the buckets over all active and joining hosts, and the joining hosts take them
  (sorted, in contiguous runs) up to that share. `history` says who was added and who returned.
- Both raise AssignError (hsx.buckets) naming what is wrong: an unknown host, no live host, a
  new host already in the assignment; neither changes its input.
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Iterable
from typing import Any

from .buckets import AssignError, format_ranges, parse_assign

# How long an unreachable host's parked buckets stay parked unless a takeover says otherwise
# (hsx_takeover_park_window; module hsx_assignment's park_window).
DEFAULT_PARK_WINDOW_S = 86400


def owned(assignment: dict[str, Any], host: str) -> set[int]:
    """The buckets the assignment gives `host` (none for "" or a host it does not name)."""
    spec = assignment["hosts"].get(host, "")
    return set(parse_assign(spec, assignment["buckets"])) if spec else set()


def split_runs(numbers: Iterable[int], hosts: list[str]) -> dict[str, set[int]]:
    """Sorted numbers over sorted hosts in contiguous near-equal runs (the first hosts one more)."""
    ordered, names = sorted(set(numbers)), sorted(hosts)
    base, extra = divmod(len(ordered), len(names))
    out, start = {}, 0
    for i, name in enumerate(names):
        size = base + (1 if i < extra else 0)
        out[name] = set(ordered[start : start + size])
        start += size
    return out


def _next(assignment: dict[str, Any], entry: dict[str, Any], now: str) -> dict[str, Any]:
    new = copy.deepcopy(assignment)
    new["epoch"] = assignment.get("epoch", 0) + 1
    new["history"] = [*assignment.get("history", []), {"epoch": new["epoch"], "at": now, **entry}]
    return new


def _age_s(since: str, now: str, host: str) -> float:
    try:
        return (datetime.datetime.fromisoformat(now) - datetime.datetime.fromisoformat(since)).total_seconds()
    except (TypeError, ValueError):
        raise AssignError(f"takeover: {host} parked since {since!r}: not an ISO 8601 time (the assignment file's "
                          "'parked'); fix it, or take the host over with its disk lost") from None


def _what_stays(
    assignment: dict[str, Any], host: str, mine: set[int], finished: Iterable[int] | None, now: str,
    recorded: dict[str, Any] | None, disk_lost: bool, park_window_s: float | None,
) -> tuple[set[int], dict[str, Any] | None, str | None]:
    """(kept, the parked entry or None, why parked buckets are released or None)."""
    before = (assignment.get("parked") or {}).get(host)
    if finished is not None:  # it answered: its own output is the truth
        return (set() if disk_lost else mine & set(finished)), None, ("answered" if before else None)
    if disk_lost:
        return set(), None, ("disk lost" if before else None)
    window = before.get("window_s", park_window_s) if before else None
    if before and window is not None and _age_s(before["since"], now, host) > window:
        return set(), None, "unreachable past the park window"
    if before:  # still unreachable, within the window: what was parked stays parked (and only that)
        parked = mine & (set(parse_assign(before["buckets"], assignment["buckets"])) if before["buckets"] else set())
        return parked, (before if parked else None), None
    parked = mine & set(recorded["finished"]) if recorded else set()
    if not parked:
        return set(), None, None
    entry = {"buckets": format_ranges(parked), "since": now, "reported_at": recorded["at"],
             "reported_by": recorded["by"],
             "window_s": int(park_window_s if park_window_s is not None else DEFAULT_PARK_WINDOW_S)}
    return parked, entry, None


def plan_takeover(
    assignment: dict[str, Any], host: str, finished: Iterable[int] | None, live: Iterable[str], now: str,
    *, recorded: dict[str, Any] | None = None, disk_lost: bool = False, park_window_s: float | None = None,
) -> tuple[dict[str, Any], dict[str, set[int]]]:
    """(the new assignment, taker -> the buckets it takes); see the module's contract."""
    hosts = assignment["hosts"]
    if host not in hosts:
        raise AssignError(f"takeover: {host} is not in the assignment (its hosts: {', '.join(sorted(hosts))})")
    retired = set(assignment.get("retired", []))
    mine = owned(assignment, host)
    kept, parked, released = _what_stays(assignment, host, mine, finished, now, recorded, disk_lost, park_window_s)
    moving = mine - kept
    before = (assignment.get("parked") or {}).get(host)
    if host in retired and not moving and parked == before:  # taken over before, and nothing changed since
        return assignment, {}
    takers = sorted(set(live) - {host} - retired)
    unknown = [h for h in takers if h not in hosts]
    if unknown:
        raise AssignError(f"takeover: live host(s) {', '.join(unknown)} are not in the assignment (a rebalance adds hosts)")
    if moving and not takers:
        raise AssignError(f"takeover: no live host to take {host}'s {len(moving)} unfinished bucket(s)")
    runs = split_runs(moving, takers) if moving else {}
    entry: dict[str, Any] = {
        "action": "takeover",
        "host": host,
        "kept": format_ranges(kept),
        "moved": {t: format_ranges(b) for t, b in runs.items() if b},
    }
    if parked:
        entry["parked"] = parked["buckets"]
    if released:
        entry["released"] = before["buckets"] if before else ""
        entry["why"] = released
    if disk_lost:
        entry["disk_lost"] = True
    new = _next(assignment, entry, now)
    new["hosts"][host] = format_ranges(kept)
    for taker, taken in runs.items():
        new["hosts"][taker] = format_ranges(owned(assignment, taker) | taken)
    new["retired"] = sorted(retired | {host})
    _set_parked(new, host, parked)
    return new, {t: b for t, b in runs.items() if b}


def _set_parked(assignment: dict[str, Any], host: str, entry: dict[str, Any] | None) -> None:
    """`host`'s parked entry set (or dropped); no `parked` key at all while nothing is parked."""
    parked = dict(assignment.get("parked") or {})
    if entry:
        parked[host] = dict(entry)
    else:
        parked.pop(host, None)
    if parked:
        assignment["parked"] = parked
    else:
        assignment.pop("parked", None)


def plan_rebalance(
    assignment: dict[str, Any], new_hosts: Iterable[str], started: Iterable[int], now: str,
    returning: Iterable[str] = (),
) -> tuple[dict[str, Any], dict[str, set[int]]]:
    """(the new assignment, joining host -> the buckets it gets); see the module's contract."""
    hosts, buckets = assignment["hosts"], assignment["buckets"]
    retired = set(assignment.get("retired", []))
    adding = sorted(set(new_hosts))
    back = sorted(set(returning))
    there = [h for h in adding if h in hosts]
    if there:
        raise AssignError(f"rebalance: host(s) {', '.join(there)} are already in the assignment")
    not_retired = [h for h in back if h not in retired]
    if not_retired:
        raise AssignError(f"rebalance: host(s) {', '.join(not_retired)} are not retired: nothing to return")
    joining = sorted(adding + back)
    if not joining:
        return assignment, {}
    active = sorted(set(hosts) - retired)
    share = buckets // (len(active) + len(joining))
    started_set = set(started)
    pool: list[int] = []
    for h in active:
        mine = owned(assignment, h)
        spare = sorted(mine - started_set, reverse=True)[: max(len(mine) - share, 0)]
        pool += spare
    pool.sort()
    gets = split_runs(pool[: share * len(joining)], joining)
    moved = set().union(*gets.values())
    entry: dict[str, Any] = {"action": "rebalance", "added": adding}
    if back:
        entry["returned"] = back
    entry["moved"] = {h: format_ranges(b) for h, b in gets.items()}
    new = _next(assignment, entry, now)
    for h in active:
        new["hosts"][h] = format_ranges(owned(assignment, h) - moved)
    for h in joining:
        new["hosts"][h] = format_ranges(owned(assignment, h) | gets[h])  # a returning host keeps what it kept
    if back:
        new["retired"] = sorted(retired - set(back))
    for h in back:  # its output was read: what it kept is its own again, not parked
        _set_parked(new, h, None)
    return new, gets
