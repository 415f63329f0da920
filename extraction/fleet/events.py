"""ansible-runner events -> what each host is doing now, shown live (terminal) or line by line.

`FleetProgress` is the state: one `HostProgress` per host, fed one runner event dict at a time
(the same dicts ansible-runner passes to `event_handler` and stores under job_events/). The
renderers only read it, so the state can be unit-tested with recorded events and no terminal.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

# Per-host outcome, worst last.
OK, FAILED, UNREACHABLE = "ok", "FAILED", "UNREACHABLE"


@dataclass
class Failure:
    task: str
    message: str
    stage: str
    ignored: bool = False


@dataclass
class HostProgress:
    """One host's run so far: its stage (role of the running task), counts and failures."""

    name: str
    stage: str = ""
    task: str = ""
    ok: int = 0
    changed: int = 0
    failed: int = 0
    skipped: int = 0
    unreachable: bool = False
    failures: list[Failure] = field(default_factory=list)
    # From the final playbook_on_stats (the truth for the verdict; None until the run ends).
    stats: dict[str, int] | None = None

    @property
    def outcome(self) -> str:
        if self.stats is not None:
            if self.stats.get("dark"):
                return UNREACHABLE
            return FAILED if self.stats.get("failures") else OK
        if self.unreachable:
            return UNREACHABLE
        return FAILED if self.failed else OK

    @property
    def failure(self) -> Failure | None:
        """The first failure that counted: the cause (later ones, like a final `fail`, repeat it)."""
        real = [f for f in self.failures if not f.ignored]
        return real[0] if real else None


def failure_message(res: Any) -> str:
    """The one line a person needs from a failed or unreachable result (no_log results stay hidden)."""
    if not isinstance(res, dict):
        return str(res or "")
    if res.get("censored"):
        return str(res["censored"])
    msg = res.get("msg")
    if not msg and res.get("stderr"):
        msg = str(res["stderr"]).strip().splitlines()[-1] if str(res["stderr"]).strip() else ""
    if not msg and isinstance(res.get("results"), list):  # a loop: the first failed item's message
        for item in res["results"]:
            if isinstance(item, dict) and item.get("failed"):
                return failure_message(item)
    if not msg and res.get("rc") not in (None, 0):
        msg = f"rc={res['rc']}"
    return " ".join(str(msg or "failed").split())


class FleetProgress:
    """Folds runner events into per-host progress. `feed()` returns what a line printer should say."""

    def __init__(self) -> None:
        self.hosts: dict[str, HostProgress] = {}
        self.play = ""
        self.finished = False
        self.report_dir: str | None = None  # recover.yml's report directory, from its set_fact result

    def host(self, name: str) -> HostProgress:
        if name not in self.hosts:
            self.hosts[name] = HostProgress(name)
        return self.hosts[name]

    def feed(self, event: dict[str, Any]) -> list[str]:
        """Apply one event; return the plain progress lines it deserves (possibly none)."""
        kind = event.get("event", "")
        data = event.get("event_data") or {}
        name = data.get("host")
        task = str(data.get("task") or "")
        stage = str(data.get("role") or "") or task
        lines: list[str] = []
        if kind == "playbook_on_play_start":
            self.play = str(data.get("play") or data.get("name") or "")
            lines.append(f"== play: {self.play}")
        elif kind == "playbook_on_stats":
            self._apply_stats(data)
        elif name and kind == "runner_on_start":
            h = self.host(name)
            if stage != h.stage:
                lines.append(f"{name}: stage {stage}")
            h.stage, h.task = stage, task
        elif name and kind in (
            "runner_on_ok",
            "runner_on_failed",
            "runner_on_skipped",
            "runner_on_unreachable",
        ):
            lines += self._apply_result(self.host(name), kind, data, stage, task)
        return lines

    def _apply_result(self, h: HostProgress, kind: str, data: dict, stage: str, task: str) -> list[str]:
        res = data.get("res") or {}
        h.stage, h.task = stage or h.stage, task or h.task
        where = f"{data['role']} : {task}" if data.get("role") else task  # as ansible-playbook names it
        if kind == "runner_on_skipped":
            h.skipped += 1
            return []
        if kind == "runner_on_unreachable":
            h.unreachable = True
            h.failures.append(Failure(where, failure_message(res), stage))
            return [f"{h.name}: UNREACHABLE at {where}: {h.failures[-1].message}"]
        if kind == "runner_on_failed":
            ignored = bool(data.get("ignore_errors"))
            h.failures.append(Failure(where, failure_message(res), stage, ignored))
            if ignored:
                h.ok += 1
                return []
            h.failed += 1
            return [f"{h.name}: FAILED at {where}: {h.failures[-1].message}"]
        # runner_on_ok
        facts = res.get("ansible_facts") if isinstance(res, dict) else None
        if isinstance(facts, dict) and facts.get("recover_report_run_dir"):
            self.report_dir = str(facts["recover_report_run_dir"]).strip()
        h.ok += 1  # as in Ansible's recap, ok counts changed results too
        if isinstance(res, dict) and res.get("changed"):
            h.changed += 1
            return [f"{h.name}: changed: {task}"]
        return []

    def _apply_stats(self, data: dict[str, Any]) -> None:
        self.finished = True
        keys = ("ok", "changed", "failures", "dark", "skipped", "rescued", "ignored")
        names = set().union(*(data.get(k) or {} for k in keys))
        for name in names:
            self.host(name).stats = {k: int((data.get(k) or {}).get(name, 0)) for k in keys}

    def any_bad(self) -> bool:
        return any(h.outcome != OK for h in self.hosts.values())

    def recap_lines(self) -> list[str]:
        """One line per host for the end of the run: verdict, counts, where and why it failed."""
        lines = []
        for h in sorted(self.hosts.values(), key=lambda h: h.name):
            s = h.stats or {"ok": h.ok, "changed": h.changed, "failures": h.failed}
            line = (
                f"{h.name:<20} {h.outcome:<11} ok={s.get('ok', 0)} changed={s.get('changed', 0)} "
                f"failed={s.get('failures', 0)}"
            )
            if s.get("rescued"):
                line += f" rescued={s['rescued']}"
            f = h.failure
            if h.outcome != OK and f:
                line += f"  at {f.task}: {f.message}"
            lines.append(line)
        return lines


class LinePrinter:
    """Not a terminal (CI, a log file): one plain line per notable event, nothing redrawn."""

    def __init__(self, progress: FleetProgress, out: TextIO = sys.stdout):
        self.progress, self.out = progress, out

    def __call__(self, event: dict[str, Any]) -> bool:
        for line in self.progress.feed(event):
            print(line, file=self.out, flush=True)
        return True  # keep the event in the artifacts

    def close(self) -> None:
        pass


class LiveTable:
    """A terminal: a per-host table redrawn in place; failures scroll above it as they happen."""

    MIN_INTERVAL_S = 0.2

    def __init__(self, progress: FleetProgress, out: TextIO = sys.stdout, title: str = ""):
        self.progress, self.out, self.title = progress, out, title
        self._drawn = 0
        self._last = 0.0
        self.started = time.monotonic()

    def __call__(self, event: dict[str, Any]) -> bool:
        lines = [ln for ln in self.progress.feed(event) if "FAILED" in ln or "UNREACHABLE" in ln]
        now = time.monotonic()
        if lines or now - self._last >= self.MIN_INTERVAL_S or event.get("event") == "playbook_on_stats":
            self.draw(lines)
            self._last = now
        return True

    def table(self) -> list[str]:
        width = shutil.get_terminal_size((100, 20)).columns - 1
        elapsed = int(time.monotonic() - self.started)
        rows = [
            f"{self.title}  play: {self.progress.play}  ({elapsed // 60}m{elapsed % 60:02d}s)",
            f"{'HOST':<18} {'STATE':<11} {'OK':>4} {'CHG':>4} {'FAIL':>4}  {'STAGE':<18} TASK",
        ]
        for h in sorted(self.progress.hosts.values(), key=lambda h: h.name):
            rows.append(
                f"{h.name:<18} {h.outcome:<11} {h.ok:>4} {h.changed:>4} {h.failed:>4}  "
                f"{h.stage[:18]:<18} {h.task}"
            )
        return [r[:width] for r in rows]

    def draw(self, log_lines: list[str] = ()) -> None:
        if self._drawn:
            self.out.write(f"\x1b[{self._drawn}F\x1b[J")  # back to the table's first line, clear below
        for line in log_lines:
            self.out.write(line + "\n")
        rows = self.table()
        self.out.write("\n".join(rows) + "\n")
        self.out.flush()
        self._drawn = len(rows)

    def close(self) -> None:
        self.draw()


def make_display(
    progress: FleetProgress, out: TextIO = sys.stdout, title: str = ""
) -> LinePrinter | LiveTable:
    return LiveTable(progress, out, title) if out.isatty() else LinePrinter(progress, out)
