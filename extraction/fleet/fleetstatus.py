"""`hsx fleet-status`: every host's extraction progress from one ad-hoc `extraction_status_info` run.

Hosts that are unreachable, whose module failed, that have no job, or whose job is not making
progress are marked (and make the exit code 1); none is left out of the table or the total. A host
the fleet's assignment file retired (taken over: `taken_over` holds the finished buckets it kept) is
marked TAKEN OVER instead, whatever its job or its reachability says: that is not an alarm (it is
left out of `fleet_total`'s `marked` and of the exit code) - unless its job runs on (a healed
partition: state running or starting, written by a live process within PROGRESS_WINDOW_S, or making
progress): then it is RETIRED_RUNNING, an alarm (it runs buckets other hosts own now). A retired
host counts in the totals with the buckets it kept only (done of them / their samples), so the
per-host total and the dataset view agree.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from extraction.fleet.events import failure_message
from extraction.fleet.playbook import (
    REPORTS,
    absolute,
    playbook_source,
    private_data_dir,
    prune_artifacts,
    runner_env,
    scrub_artifacts,
)
from hsx.buckets import AssignError, parse_assign
from hsx.status import format_eta, parse_status

DEFAULT_OUTPUT_DIR = "/data/hsx/output"
OUTPUT_DIR_ARG = "{{ hsx_output_dir | default('" + DEFAULT_OUTPUT_DIR + "') }}"
KEEP_ARTIFACTS = 5  # fleet-status runs kept (its own kind: recover/provision/rollout keep theirs)
ARTIFACT_KIND = "fleet-status"
UNREACHABLE, FAILED, NO_JOB, STALLED = "UNREACHABLE", "MODULE FAILED", "NO JOB", "NOT PROGRESSING"
TAKEN_OVER = "TAKEN OVER"  # retired by a takeover: expected, never an alarm
RETIRED_RUNNING = "TAKEN OVER, STILL RUNNING"  # retired, yet its job runs on (a healed partition): an alarm
PROGRESS_WINDOW_S = 120  # extraction_status_info's progress_window: a status this fresh has a live writer


@dataclass
class HostStatus:
    """One host's answer: the module's result, or why there is none."""

    host: str
    result: dict[str, Any] = field(default_factory=dict)
    unreachable: bool = False
    error: str = ""
    history: list[list[float]] = field(default_factory=list)
    # The bucket spec a takeover left the host (its finished buckets, "" for none); None: not taken over.
    taken_over: str | None = None
    # Of those, the ones parked on it (taken over while it did not answer; the assignment's `parked`).
    parked: str | None = None

    @property
    def retired_running(self) -> bool:
        """Retired, and its job runs on: it answered with state running or starting, and makes
        progress or a live process wrote its status within PROGRESS_WINDOW_S."""
        r = self.result
        if self.taken_over is None or self.unreachable or self.error or r.get("state") not in ("running", "starting"):
            return False
        age = r.get("status_age_s")
        fresh = r.get("pid_alive") is True and isinstance(age, int | float) and age <= PROGRESS_WINDOW_S
        return bool(r.get("making_progress")) or fresh

    def kept(self) -> tuple[int, int] | None:
        """(samples done, samples) of the buckets a retired host kept, from its own reading; None
        when it gave none (unreachable, no bucket totals) or it is not retired."""
        r = self.result
        totals, n = r.get("bucket_totals"), r.get("bucket_count")
        if self.taken_over is None or not isinstance(totals, list) or not isinstance(n, int) or len(totals) != n:
            return None
        try:
            mine = parse_assign(self.taken_over, n) if self.taken_over else []
        except AssignError:
            return None
        done = r.get("bucket_done") or {}
        return (sum(min(int(done.get(str(b), 0)), totals[b]) for b in mine), sum(totals[b] for b in mine))

    @property
    def mark(self) -> str:
        """Empty when the host is fine (done, or running and making progress); TAKEN_OVER for a retired
        host, RETIRED_RUNNING for one whose job runs on."""
        if self.taken_over is not None:
            return RETIRED_RUNNING if self.retired_running else TAKEN_OVER
        if self.unreachable:
            return UNREACHABLE
        if self.error:
            return FAILED
        state = self.result.get("state", "none")
        if state == "none":
            return NO_JOB
        if state == "done" or self.result.get("making_progress"):
            return ""
        return STALLED

    @property
    def alarm(self) -> bool:
        """A mark that asks for a person (any but TAKEN_OVER; RETIRED_RUNNING is one)."""
        return self.mark not in ("", TAKEN_OVER)

    @property
    def reason(self) -> str:
        if self.retired_running:
            r = self.result
            age = r.get("last_progress_age_s")
            return (f"taken over, yet its job runs (state {r.get('state')}, {float(r.get('samples_per_s') or 0):.2f} "
                    f"samples/s, last progress {_age(age)}): it runs buckets other hosts own now; stop it: "
                    f"hsx takeover {self.host}")
        if self.taken_over is not None:
            return self._taken_over_reason()
        if self.unreachable or self.error:
            return self.error
        r = self.result
        if self.mark != STALLED:
            return r.get("message", "") if self.mark else ""
        why = [f"state {r.get('state')}"]
        if r.get("pid_alive") is False:
            why.append(f"pid {r.get('pid')} not running")
        if r.get("message"):
            why.append(str(r["message"]))
        return "; ".join(why)

    def _taken_over_reason(self) -> str:
        kept = self.taken_over or ""
        keeps = f"keeps its finished bucket(s) {kept}" if kept else "keeps no bucket"
        if self.parked:
            keeps += f" (parked: {self.parked}, as it last reported them finished)"
        now = ("not reachable now" if self.unreachable else "its status unreadable now" if self.error
               else f"its output holds {self.result.get('done', '?')} samples")
        return f"its unfinished buckets moved to other hosts; {keeps}; {now}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "mark": self.mark or None,
            "reason": self.reason or None,
            "unreachable": self.unreachable,
            "taken_over": self.taken_over,
            **{k: v for k, v in self.result.items() if k != "invocation"},
        }


class StatusCollector:
    """Runner event handler for the ad-hoc run: the last result per host."""

    def __init__(self) -> None:
        self.hosts: dict[str, HostStatus] = {}

    def __call__(self, event: dict[str, Any]) -> bool:
        kind = event.get("event", "")
        data = event.get("event_data") or {}
        name = data.get("host")
        if not name or kind not in ("runner_on_ok", "runner_on_failed", "runner_on_unreachable"):
            return True
        res = data.get("res") or {}
        h = self.hosts.setdefault(name, HostStatus(name))
        if kind == "runner_on_unreachable":
            h.unreachable, h.error = True, failure_message(res)
        elif kind == "runner_on_failed":
            h.error = failure_message(res)
        elif data.get("task_action", "").endswith("slurp"):
            h.history = _history_from_slurp(res)
        else:
            h.result = dict(res)
        return True


def _history_from_slurp(res: dict[str, Any]) -> list[list[float]]:
    """The history of a slurped status.json; [] for one that is not a status (hsx.status decides)."""
    import base64

    try:
        status = parse_status(base64.b64decode(res.get("content", "")), "status.json (slurped)")
    except (ValueError, TypeError):
        return []
    return [[float(t), int(d)] for t, d in status.get("history") or []]


def _adhoc(
    collector: StatusCollector,
    module: str,
    module_args: str,
    inventory: list[str] | None,
    limit: str | None,
    become: bool,
    report_dir: Path,
) -> Any:
    import ansible_runner

    cmdline = "--become" if become else None
    ident = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{ARTIFACT_KIND}-{module.rsplit('.', 1)[-1]}"
    pdd = private_data_dir(report_dir)
    runner = ansible_runner.run(
        private_data_dir=str(pdd),
        module=module,
        module_args=module_args,
        host_pattern=limit or "all",
        inventory=[absolute(i) for i in inventory] if inventory else None,
        cmdline=cmdline,
        envvars=runner_env(),
        ident=ident,
        rotate_artifacts=0,  # ours, per kind: never another kind's runs
        suppress_env_files=True,
        quiet=True,
        event_handler=collector,
    )
    scrub_artifacts(runner.config.artifact_dir)
    prune_artifacts(pdd, ARTIFACT_KIND, KEEP_ARTIFACTS)
    return runner


def collect(
    inventory: list[str] | None,
    limit: str | None = None,
    become: bool = False,
    with_history: bool = False,
    report_dir: Path = REPORTS,
) -> tuple[list[HostStatus], Any]:
    """One ad-hoc run of extraction_status_info over the fleet (plus one slurp of status.json for plots)."""
    collector = StatusCollector()
    module = playbook_source().module("extraction_status_info")  # the checkout's, else hsx.recovery's (FQCN)
    runner = _adhoc(
        collector, module, f"path={OUTPUT_DIR_ARG} buckets=true", inventory, limit, become,
        report_dir,
    )
    if with_history:
        _adhoc(
            collector,
            "ansible.builtin.slurp",
            f"src={OUTPUT_DIR_ARG}/status.json",
            inventory,
            limit,
            become,
            report_dir,
        )
    return sorted(collector.hosts.values(), key=lambda h: h.host), runner


def done_total(h: HostStatus) -> tuple[int, int | None] | None:
    """What a host counts for in the totals: (done, total) of its reading; of a retired host, of the
    buckets it kept (HostStatus.kept); None when it gave nothing to count."""
    if h.taken_over is not None:
        return h.kept()
    if not h.result:
        return None
    total = h.result.get("total")
    return int(h.result.get("done") or 0), int(total) if total is not None else None


def fleet_total(hosts: list[HostStatus]) -> dict[str, Any]:
    """Samples done/total and the rate over the hosts (a retired host: its kept buckets, its rate
    never); `marked`: host -> mark for the alarms only (a host taken over is listed in `taken_over`
    instead, and in `marked` too while its job runs on)."""
    counted = [c for c in (done_total(h) for h in hosts) if c is not None]
    done = sum(d for d, _ in counted)
    total = sum(t or 0 for _, t in counted)
    rate = round(sum(float(h.result.get("samples_per_s") or 0) for h in hosts
                     if h.result.get("making_progress") and h.taken_over is None), 3)
    remaining = max(total - done, 0)
    return {
        "hosts": len(hosts),
        "done": done,
        "total": total,
        "samples_per_s": rate,
        "eta_s": round(remaining / rate, 1) if rate > 0 else None,
        "marked": {h.host: h.mark for h in hosts if h.alarm},
        "taken_over": sorted(h.host for h in hosts if h.taken_over is not None),
    }


def _age(v: Any) -> str:
    return "?" if not isinstance(v, int | float) else f"{v:.0f}s" if v < 120 else format_eta(v) + " ago"


def render(hosts: list[HostStatus], out: TextIO = sys.stdout) -> None:
    print(
        f"{'HOST':<18} {'STATE':<16} {'DONE':>15} {'SAMPLES/S':>9} {'ETA':>8} {'PROGRESS':>10}  MARK",
        file=out,
    )
    for h in hosts:
        r = h.result
        done, total = done_total(h) or (r.get("done"), r.get("total"))
        pct = f" {100 * done / total:5.1f}%" if r and total else ""
        idle = h.mark == TAKEN_OVER  # its stale rate and ETA are no one's
        cells = (
            f"{done}/{total if total is not None else '?'}{pct}" if r else "-",
            f"{float(r.get('samples_per_s') or 0):.2f}" if r and not idle else "-",
            format_eta(r.get("eta_s")) if r and not idle else "-",
            _age(r.get("last_progress_age_s")) if r else "-",
        )
        mark = f"{h.mark}: {h.reason}" if h.mark and h.reason else h.mark
        state = r.get("state", "-") if r else "-"
        if h.mark == TAKEN_OVER:  # what its stale status says is not what it does
            state = "retired"
        print(
            f"{h.host:<18} {state[:16]:<16} {cells[0]:>15} {cells[1]:>9} {cells[2]:>8} {cells[3]:>10}  {mark}",
            file=out,
        )
    t = fleet_total(hosts)
    pct = f" ({100 * t['done'] / t['total']:.1f}%)" if t["total"] else ""
    print(
        f"FLEET: {t['hosts']} hosts, done {t['done']}/{t['total']}{pct}, {t['samples_per_s']} samples/s, "
        f"ETA {format_eta(t['eta_s'])}; {len(t['marked'])} marked"
        + (f", {len(t['taken_over'])} taken over" if t["taken_over"] else ""),
        file=out,
    )


def as_json(hosts: list[HostStatus], dataset: dict[str, Any] | None = None) -> str:
    """'hosts' (each host's reading, less the per-bucket lists), 'total' and, with a bucket view, 'dataset'
    (fleetbuckets.fleet_view)."""
    bulky = ("bucket_done", "bucket_totals")
    rows = [{k: v for k, v in h.as_dict().items() if k not in bulky} for h in hosts]
    data: dict[str, Any] = {"hosts": rows, "total": fleet_total(hosts)}
    if dataset is not None:
        data["dataset"] = dataset
    return json.dumps(data, indent=2, sort_keys=True)
