"""What a run prints about its progress: the tqdm bar on a terminal, one line at a cadence in a
log (a systemd job's journal, a file), and one closing summary on every exit.

Contract:
- progress_mode(--progress, stderr is a terminal) -> "bar" | "lines" | "off": auto is the bar on a
  terminal and lines elsewhere; on is the bar; lines is lines; off prints neither.
- ProgressLines.start() logs the first line when the run starts; tick() (the status thread's, every
  --status-interval seconds) logs one more once --progress-interval seconds have passed since the
  last (0: only the first). Lines are read from the run's counters and never block the run.
- closing_line(reporter, code) is the run's last line, whatever ended it (done, failed, paused, a
  signal): where it stopped, what it did, its exit status and what to do next; a run that did not
  finish says how to resume (the exact command where this process is `hsx`).
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Callable

from hsx.status import ERRORS_NAME, StatusReporter, format_eta

MODES = ("auto", "on", "lines", "off")


def progress_mode(want: str, isatty: bool) -> str:
    """'bar', 'lines' or 'off' for --progress `want` (see the module's contract)."""
    if want == "off":
        return "off"
    if want == "lines" or (want == "auto" and not isatty):
        return "lines"
    return "bar"


def progress_line(r: StatusReporter) -> str:
    """One line of the run's counters: done/total, rates, errors, ETA."""
    sps, tps = r.snapshot_rates()
    with r.lock:
        done, total, errors, rows = r.done, r.total, r.errors, r.row_errors
    pct = f" ({100 * done / total:.1f}%)" if total else ""
    eta = format_eta(max(total - done, 0) / sps) if sps > 0 else "?"
    return (
        f"progress: {done}/{total}{pct} samples, {sps:.2f} samples/s, {tps:.0f} tokens/s, "
        f"errors {errors}, rows skipped {rows}, ETA {eta}"
    )


class ProgressLines:
    """One progress line every `every_s` seconds (see the module's contract); `clock` for tests."""

    def __init__(
        self,
        reporter: StatusReporter,
        log: Callable[[str], None],
        every_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.reporter, self.log, self.every_s, self.clock = reporter, log, every_s, clock
        self.last = 0.0

    def start(self) -> None:
        self.last = self.clock()
        cadence = f"a line every {self.every_s:g} s" if self.every_s > 0 else "no further lines until the end"
        self.log(f"{progress_line(self.reporter)} ({cadence}: --progress-interval)")

    def tick(self) -> None:
        now = self.clock()
        if self.every_s > 0 and now - self.last >= self.every_s:
            self.last = now
            self.log(progress_line(self.reporter))


def resume_command(argv: list[str] | None = None) -> str:
    """How to run this again: the exact command when this process is `hsx` (its console script),
    else a hint."""
    argv = sys.argv if argv is None else argv
    if argv and os.path.basename(argv[0]) == "hsx" and argv[1:2] == ["extract"]:
        return shlex.join(argv)
    return "the same `hsx extract` command (a systemd job: start its unit again)"


def closing_line(r: StatusReporter, code: int | None, output: str, argv: list[str] | None = None) -> str:
    """The run's last line (module contract), from the state exit_code() set; `code` None: the run
    ended by an exception (its traceback follows)."""
    with r.lock:
        state, message = r.state, r.message
        done, total, written, there = r.done, r.total, r.written, r.skipped_existing
        errors, rows = r.errors, r.row_errors
    if code is None:
        state, message = "failed", "an unexpected error (its traceback follows)"
    tally = (
        f"{done}/{total} samples ({written} written this run, {there} already there), "
        f"{errors} failed, {rows} rows skipped; exit {code if code is not None else 'on an error'}"
    )
    if state == "done":
        return f"summary: done {tally}"
    again = f"run again to resume (finished shards are kept): {resume_command(argv)}"
    if state == "interrupted":
        return f"summary: stopped at {tally} - {message}; {again}"
    if state.startswith("paused"):
        return f"summary: paused at {tally} - {message.split(';')[0]}; free space on {output}, then {again}"
    return (
        f"summary: failed at {tally} - {message}; see {os.path.join(output, ERRORS_NAME)} and this log, "
        f"fix the cause, then {again}"
    )
