"""The whole dataset in one view (issue #39 item 4): buckets and samples over the fleet, from what
each host's extraction_status_info (buckets=true) read on its own disk and the assignment file.

Contract (`fleet_view(hosts, assignment)`):
- A bucket is **done** when some host's output holds all of its samples (the count the jobs wrote
  in buckets.json); else **running** when its owner (the assignment file; without one, the host
  whose job runs it) answered and its job runs it, **unreachable** when its owner did not answer,
  **unassigned** when no host owns it or its owner's job does not run it yet (config not rendered).
- Samples, per bucket: `copies` is the sum of every host's count. A done bucket has exactly its
  total distinct samples, so the copies beyond them are copies - total (exact), and `done twice`
  (done more than once) is at most total of them. In a bucket no host has
  finished, distinct >= the largest host count: that lower bound is used (done, done once) and
  `missing` = total - it is an upper bound; `exact` says whether every bucket was exact. So
  `missing` is never under-counted: 0 means every sample exists on some host.
- Without totals from any host (no buckets.json yet) nothing is counted done; `known` is false.
- The hosts' copies of the dataset must agree (issue #51): every answering host that reports totals
  must report the same per-bucket counts, the same bucket count, and the same dataset hash (run.json's
  `dataset_hash`, where given). Otherwise `inconsistent` names the hosts and buckets that disagree,
  each bucket is counted against the largest total any host reports (so `missing` stays an upper
  bound), and the dataset is never `complete`. No host's counts are taken as the truth.
- Per host: the buckets it owns by state, the samples its index holds, and how many of those lie
  in buckets it does not own (taken over from it, or earlier work).
- Parked buckets (issue #51: a takeover of a host that did not answer left it the buckets it last
  reported finished, the assignment's `parked`): `parked` maps each such host to those of them not
  done now (its output not read, or no longer holding them), with the park's times, its window
  (`window_s`: the entry's, as the takeover that releases them reads it; hsx.fleetplan's default for
  an entry without one) and whether the host answered. They count as nothing done until a host's output holds them, so the fleet is not
  complete while any is parked; render_view says why and how to release them.
"""

from __future__ import annotations

import datetime
from collections import Counter
from typing import Any

from extraction.selfheal.promtext import escape_label
from hsx.buckets import AssignError, format_ranges, parse_assign
from hsx.fleetplan import DEFAULT_PARK_WINDOW_S

STATES = ("done", "running", "unreachable", "unassigned")


def _spec(spec: str | None, buckets: int) -> set[int]:
    try:
        return set(parse_assign(spec, buckets)) if spec else set()
    except AssignError:
        return set()


def fleet_view(hosts: list[Any], assignment: dict[str, Any] | None) -> dict[str, Any]:
    """The fleet's buckets and samples (module contract); `hosts` are fleetstatus.HostStatus."""
    # A host whose index could not be read (buckets_error) tells nothing of its buckets: not answered.
    answered = {h.host: h.result for h in hosts
                if h.result and not h.unreachable and not h.error and not h.result.get("buckets_error")}
    counts = [r.get("bucket_count") for r in answered.values() if r.get("bucket_count")]
    n = assignment["buckets"] if assignment else (counts[0] if counts else None)
    if not n:
        return {"known": False, "reason": "no host reports a run with buckets (and no assignment file)"}
    totals, inconsistent = _agreed_totals(answered, n)
    if assignment:
        owner = {b: h for h, s in assignment["hosts"].items() for b in _spec(s, n)}
    else:
        owner = {b: h for h, r in answered.items() for b in _spec(r.get("assign"), n)}
    # What each host's job runs: its --assign; all buckets for a run made with buckets but no
    # --assign; nothing where no run has written its buckets yet (a job not started).
    runs = {h: _spec(r.get("assign"), n) if r.get("assign") else set(range(n)) if r.get("bucket_count") == n
            else set() for h, r in answered.items()}
    done_by = {h: {int(b): c for b, c in (r.get("bucket_done") or {}).items()}
               for h, r in answered.items() if r.get("bucket_count") == n}
    retired = set(assignment.get("retired", [])) if assignment else set()
    state: dict[int, str] = {}
    samples = {"total": 0, "done": 0, "done_once": 0, "done_twice": 0, "missing": 0}
    exact = totals is not None and inconsistent is None
    for b in range(n):
        held = [c[b] for c in done_by.values() if c.get(b)]
        total = totals[b] if totals else None
        copies = sum(held)
        if total is not None and max(held, default=0) >= total:
            state[b], distinct = "done", total
        else:
            h = owner.get(b)
            state[b] = ("unassigned" if h is None or (h in answered and b not in runs.get(h, set()))
                        else "running" if h in answered else "unreachable")
            distinct = max(held, default=0)
            exact = exact and len(held) <= 1
        # Counts, not ids: the copies beyond the first are `extra`; at most `distinct` samples can
        # be done more than once (three hosts with the whole bucket: each sample twice over).
        extra = copies - distinct
        twice = min(extra, distinct)
        samples["total"] += total if total is not None else 0
        samples["done"] += distinct
        samples["done_twice"] += twice
        samples["done_once"] += distinct - twice
        samples["missing"] += (total - distinct) if total is not None else 0
    per_host: dict[str, dict[str, Any]] = {}
    for h in sorted({*(assignment["hosts"] if assignment else {}), *(x.host for x in hosts)}):
        mine = [b for b, o in owner.items() if o == h]
        counts_h = done_by.get(h, {})
        per_host[h] = {
            "buckets": {s: sum(1 for b in mine if state[b] == s) for s in STATES},
            "owned": len(mine),
            "samples_done": sum(counts_h.values()) if h in done_by else None,
            "samples_elsewhere": sum(c for b, c in counts_h.items() if owner.get(b) != h) if h in done_by else None,
            "answered": h in answered,
            "retired": h in retired,
        }
    parked = _pending_parked(assignment, state, n, answered)
    return {
        "parked": parked,
        "known": totals is not None,
        "buckets": n,
        "bucket_states": {s: sum(1 for v in state.values() if v == s) for s in STATES},
        "samples": samples,
        "exact": exact,
        "complete": totals is not None and samples["missing"] == 0 and inconsistent is None,
        "inconsistent": inconsistent,
        "retired": sorted(retired),
        "epoch": assignment.get("epoch", 0) if assignment else None,
        "per_host": per_host,
    }


def _pending_parked(
    assignment: dict[str, Any] | None, state: dict[int, str], n: int, answered: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Host -> its parked buckets that are not done now, with the park's times (module contract)."""
    out: dict[str, dict[str, Any]] = {}
    for h, entry in sorted(((assignment or {}).get("parked") or {}).items()):
        pending = sorted(b for b in _spec(entry.get("buckets"), n) if state.get(b) != "done")
        if pending:
            out[h] = {"buckets": format_ranges(pending), "count": len(pending), "since": entry.get("since"),
                      "reported_at": entry.get("reported_at"), "reported_by": entry.get("reported_by"),
                      "window_s": entry.get("window_s", DEFAULT_PARK_WINDOW_S), "answered": h in answered}
    return out


def _parked_lines(view: dict[str, Any]) -> list[str]:
    """One PARKED line per host holding parked buckets not done, saying why and how to release them."""
    lines = []
    for h, p in view.get("parked", {}).items():
        now = ("it answers, but its output does not hold them all now: hsx takeover " + h + " moves what it lacks"
               if p["answered"] else
               f"they count once its output is read again: bring {h} back (it runs nothing), or if its disk is "
               f"gone redo them now: hsx takeover {h} --disk-lost (a takeover after the park window, "
               f"{p['window_s']} s from then, redoes them; nothing runs one by itself)")
        lines.append(f"PARKED: {p['count']} bucket(s) {p['buckets']} on {h}, taken over while not answering "
                     f"(parked since {p['since']}; finished there by its {p['reported_by']} report of "
                     f"{p['reported_at']}): {now}")
    return lines


def _odd_ones(values: dict[str, Any]) -> list[str]:
    """The hosts whose value is not the one most hosts give; every host when no value has a majority."""
    if len(set(values.values())) <= 1:
        return []
    (common, most), *rest = Counter(values.values()).most_common()
    if rest and rest[0][1] == most:
        return sorted(values)
    return sorted(h for h, v in values.items() if v != common)


def _agreed_totals(answered: dict[str, dict[str, Any]], n: int) -> tuple[list[int] | None, dict[str, Any] | None]:
    """(per-bucket totals to count against, what disagrees or None); see the module's contract."""
    per_host = {h: list(r["bucket_totals"]) for h, r in answered.items()
                if r.get("bucket_count") == n and isinstance(r.get("bucket_totals"), list)
                and len(r["bucket_totals"]) == n}
    totals = [max(t[b] for t in per_host.values()) for b in range(n)] if per_host else None
    differ = {b for b in range(n) if len({t[b] for t in per_host.values()}) > 1} if per_host else set()
    hashes = {h: str(r["dataset_hash"]) for h, r in answered.items() if r.get("dataset_hash")}
    counts = {h: r["bucket_count"] for h, r in answered.items() if r.get("bucket_count") not in (None, n)}
    if not differ and len(set(hashes.values())) <= 1 and not counts:
        return totals, None
    odd = set(_odd_ones({h: tuple(t) for h, t in per_host.items()})) | set(_odd_ones(hashes)) | set(counts)
    return totals, {
        "hosts": sorted(odd),
        "buckets": format_ranges(differ),
        "dataset_hashes": hashes if len(set(hashes.values())) > 1 else {},
        "bucket_counts": counts,
    }


def _inconsistent_line(view: dict[str, Any]) -> str:
    """What disagrees, for people: the hosts, the buckets, the dataset hashes, the bucket counts."""
    bad = view["inconsistent"]
    why = []
    if bad["buckets"]:
        others = sorted(set(view["per_host"]) - set(bad["hosts"]))
        named = ", ".join(bad["hosts"])
        whom = f" from {', '.join(others)}" if len(bad["hosts"]) < len(view["per_host"]) and others else ""
        why.append(f"{'hosts' if len(bad['hosts']) > 1 else 'host'} {named} count bucket(s) {bad['buckets']} "
                   f"differently{whom}")
    if bad["dataset_hashes"]:
        why.append("dataset hash " + ", ".join(f"{h} {v[:12]}" for h, v in sorted(bad["dataset_hashes"].items())))
    why += [f"{h} runs {c} buckets, the fleet {view['buckets']}" for h, c in sorted(bad["bucket_counts"].items())]
    return ("INCONSISTENT: the hosts' copies of the dataset disagree (" + "; ".join(why) + "): give every host "
            "the same dataset file (hsx_dataset_path), then run hsx recover; until then nothing is called complete")


def mark_taken_over(hosts: list[Any], assignment: dict[str, Any] | None) -> None:
    """Set `taken_over` (the buckets it kept) on each host the assignment file retired, so the
    per-host table and the exit code read it as taken over, not by its stale job or reachability."""
    retired = set(assignment.get("retired", [])) if assignment else set()
    parked = (assignment or {}).get("parked") or {}
    for h in hosts:
        if h.host in retired:
            h.taken_over = assignment["hosts"].get(h.host, "")
            h.parked = parked.get(h.host, {}).get("buckets")


def render_view(view: dict[str, Any]) -> list[str]:
    """The view as lines for people (after fleetstatus.render's table)."""
    if not view.get("known"):
        return [f"BUCKETS: unknown ({view.get('reason', 'no host reports bucket totals yet (buckets.json)')})"]
    lines = [f"{'HOST':<18} {'OWNS':>6} {'DONE':>6} {'RUNNING':>8} {'UNREACH':>8} {'UNASSIGNED':>10} "
             f"{'SAMPLES':>8} {'ELSEWHERE':>9}"]
    for h, v in view["per_host"].items():
        b = v["buckets"]
        tag = " (retired)" if v["retired"] else ""
        lines.append(
            f"{h:<18} {v['owned']:>6} {b['done']:>6} {b['running']:>8} {b['unreachable']:>8} {b['unassigned']:>10} "
            f"{'-' if v['samples_done'] is None else v['samples_done']:>8} "
            f"{'-' if v['samples_elsewhere'] is None else v['samples_elsewhere']:>9}{tag}"
        )
    s, bs = view["samples"], view["bucket_states"]
    bad = view.get("inconsistent")
    approx = ("" if view["exact"] else " (at most; the hosts' counts disagree)" if bad
              else " (at most; some buckets are shared mid-run)")
    if bad:
        lines.append(_inconsistent_line(view))
    lines += _parked_lines(view)
    parked = sum(p["count"] for p in view.get("parked", {}).values() if not p["answered"])
    verdict = ("COMPLETE" if view["complete"] else
               "INCOMPLETE (inconsistent: the hosts' copies of the dataset disagree)" if bad else
               f"INCOMPLETE ({parked} bucket(s) parked on a host not answering: see PARKED)" if parked else "INCOMPLETE")
    lines.append(
        f"DATASET: {view['buckets']} buckets: {bs['done']} done, {bs['running']} running, {bs['unreachable']} on "
        f"unreachable hosts, {bs['unassigned']} unassigned; samples {s['done']}/{s['total']} done "
        f"({s['done_once']} once, {s['done_twice']} twice), {s['missing']} missing{approx}: {verdict}"
    )
    return lines


def prometheus_text(view: dict[str, Any], hosts: list[Any] | None = None) -> str:
    """The same numbers as Prometheus text (`hsx fleet-status --prom FILE`, for node_exporter's
    textfile collector on the control node): per host its buckets by state and samples, and the
    fleet's samples by kind; whether the hosts' copies of the dataset agree; with `hosts`
    (fleetstatus.HostStatus, after mark_taken_over), each retired host and whether its job runs."""
    out = [
        "# HELP hsx_fleet_buckets Buckets a host owns in the fleet's assignment, by state.",
        "# TYPE hsx_fleet_buckets gauge",
    ]
    if view.get("known"):
        for h, v in view["per_host"].items():
            for s, c in v["buckets"].items():
                out.append(f'hsx_fleet_buckets{{host="{escape_label(h)}",state="{s}"}} {c}')
    out += ["# HELP hsx_fleet_host_samples_done Samples in a host's index (its own disk).",
            "# TYPE hsx_fleet_host_samples_done gauge"]
    if view.get("known"):
        for h, v in view["per_host"].items():
            if v["samples_done"] is not None:
                out.append(f'hsx_fleet_host_samples_done{{host="{escape_label(h)}"}} {v["samples_done"]}')
    out += ["# HELP hsx_fleet_samples The dataset's samples over the fleet: done once, done twice, missing.",
            "# TYPE hsx_fleet_samples gauge"]
    if view.get("known"):
        for k in ("total", "done_once", "done_twice", "missing"):
            out.append(f'hsx_fleet_samples{{kind="{k}"}} {view["samples"][k]}')
    out += ["# HELP hsx_fleet_complete 1 when every sample of the dataset is done on some host.",
            "# TYPE hsx_fleet_complete gauge", f"hsx_fleet_complete {1 if view.get('complete') else 0}"]
    out += ["# HELP hsx_fleet_consistent 1 when the hosts' copies of the dataset agree (bucket counts, dataset hash).",
            "# TYPE hsx_fleet_consistent gauge"]
    if view.get("known"):
        out.append(f"hsx_fleet_consistent {0 if view.get('inconsistent') else 1}")
    retired = [h for h in hosts or [] if h.taken_over is not None]
    out += ["# HELP hsx_fleet_retired 1 for a host the fleet's assignment retired (taken over).",
            "# TYPE hsx_fleet_retired gauge"]
    out += [f'hsx_fleet_retired{{host="{escape_label(h.host)}"}} 1' for h in retired]
    out += ["# HELP hsx_fleet_retired_running 1 while a retired host's job runs on (stop it: hsx takeover HOST).",
            "# TYPE hsx_fleet_retired_running gauge"]
    out += [f'hsx_fleet_retired_running{{host="{escape_label(h.host)}"}} {1 if h.retired_running else 0}'
            for h in retired]
    out += ["# HELP hsx_fleet_parked_buckets Buckets parked on a host taken over while not answering, not done yet "
            "(they count once its output is read; hsx takeover HOST --disk-lost redoes them).",
            "# TYPE hsx_fleet_parked_buckets gauge"]
    out += [f'hsx_fleet_parked_buckets{{host="{escape_label(h)}"}} {p["count"]}' for h, p in view.get("parked", {}).items()]
    out += ["# HELP hsx_fleet_parked_since_timestamp_seconds When a host's buckets were parked (its park window runs "
            "from here).", "# TYPE hsx_fleet_parked_since_timestamp_seconds gauge"]
    out += [f'hsx_fleet_parked_since_timestamp_seconds{{host="{escape_label(h)}"}} {_epoch_s(p["since"])}'
            for h, p in view.get("parked", {}).items() if _epoch_s(p["since"]) is not None]
    out += ["# HELP hsx_fleet_parked_window_seconds How long a host's buckets stay parked from then (its park window, "
            "as the parking takeover set it); past it a takeover redoes them, but nothing runs one by itself "
            "(alert HsxParkedPastWindow).", "# TYPE hsx_fleet_parked_window_seconds gauge"]
    out += [f'hsx_fleet_parked_window_seconds{{host="{escape_label(h)}"}} {p["window_s"]}'
            for h, p in view.get("parked", {}).items() if _epoch_s(p["since"]) is not None]
    return "\n".join(out) + "\n"


def _epoch_s(iso: Any) -> int | None:
    """Seconds since the epoch of an ISO 8601 time (None when it is not one)."""
    try:
        return int(datetime.datetime.fromisoformat(str(iso)).timestamp())
    except ValueError:
        return None
