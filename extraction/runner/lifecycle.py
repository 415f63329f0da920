"""Lifecycle: the run's state and its bookkeeping: signals, the pause, the abort, errors.jsonl,
status.json's counters, the progress bar or lines (progress.py) and the exit status.

Contract:
- One Lifecycle per run, shared by every stage; it is the Ledger a Publisher reports into
  (extraction/publish/publisher.py). Its methods may be called from any of the run's threads.
- `stop_event` is set when the run must take no new batch: a signal, a pause, an abort, too many
  failures in a row. `abandon_event` (a second signal) and a pause also stop publishing
  (`stopped_writing`): what is not published stays pending, for a rerun. `forward_done`: no
  batch will be put to the publisher any more.
- The first SIGINT/SIGTERM finishes the batches in flight, then stops; the second abandons what
  is not published yet.
- errors.jsonl gets one JSON line per failed sample, malformed row or redone shard.
- exit_code() gives the run's exit status from what happened and sets status.json's final state:
  a failure beside a pause is a failure (1: the job unit restarts it; a pause is left to a
  person); a pause 75; a signal 130/143; an abort 1; no valid row at all (every row skipped, or
  an empty dataset on a single node) 1, naming the shapes a row must have and the first bad
  line; samples missing 1; else 0.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from extraction.backends.base import Sample
from extraction.inputs.config import ExtractConfig
from extraction.inputs.dataset import ROW_SHAPES
from extraction.publish.diskguard import DiskGuard, DiskLow
from extraction.publish.publisher import Outcome, Work
from extraction.runner.progress import ProgressLines, progress_mode
from extraction.shards import DiskFullError
from hsx.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_PAUSED, EXIT_SIGINT, EXIT_SIGTERM, EXIT_USAGE
from hsx.fsutil import LinkRefused, nofollow_opener
from hsx.status import ERRORS_NAME, STATE_DISK_LOW, StatusReporter, now_iso


class RunError(Exception):
    """Stops the run before any work; `code` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


class Lifecycle:
    """The run's state (see the module's contract). `reporter` and `guard` are set by the
    runner's prepare(), before any stage runs; `on_abandon` by whoever must hear a second signal."""

    def __init__(self, cfg: ExtractConfig, log: Callable[[str], None], timings: dict[str, float]):
        self.cfg = cfg
        self.log = log
        self.timings = timings
        self.stop_event = threading.Event()
        self.forward_done = threading.Event()
        self.abandon_event = threading.Event()
        self.stop_signal: int | None = None
        self.pause: DiskLow | DiskFullError | None = None
        self.abort: str | None = None
        self.consecutive_errors = 0
        self.failed_samples: set[str] = set()
        self.reporter: StatusReporter = None  # type: ignore[assignment]
        self.guard: DiskGuard = None  # type: ignore[assignment]
        self.bar: Any = None
        self.on_abandon: Callable[[], None] | None = None
        self.first_row_error: dict[str, Any] | None = None  # the lowest line of a skipped row
        self._errors_lock = threading.Lock()

    # ------------------------------------------------------------------ records

    def error(self, record: dict[str, Any]) -> None:
        """One line of errors.jsonl; never written through a link put at its name (a RunError
        that names it: root would append to whatever the link points at)."""
        record = {"time": now_iso(), **record}
        path = os.path.join(self.cfg.output, ERRORS_NAME)
        with self._errors_lock:
            if record.get("kind") == "row" and isinstance(record.get("line"), int):
                first = self.first_row_error
                if first is None or record["line"] < first["line"]:
                    self.first_row_error = record
            try:
                f = open(path, "a", encoding="utf-8", opener=nofollow_opener)
            except LinkRefused as e:
                raise RunError(str(e)) from None
            with f:
                f.write(json.dumps(record, sort_keys=True) + "\n")

    def row_error(self, record: dict[str, Any]) -> None:
        """A row the tokenizer could not take: recorded, and out of the run's total."""
        self.error(record)
        with self.reporter.lock:
            self.reporter.row_errors += 1
            self.reporter.total -= 1

    def sample_failed(self, sample: Sample, reason: str, attempts: int | None = None) -> None:
        self.failed_samples.add(sample.sample_id)
        self.reporter.add_error()
        rec = {
            "kind": "sample",
            "sample_id": sample.sample_id,
            "line": sample.meta.get("line"),
            "reason": reason,
        }
        if attempts is not None:
            rec["attempts"] = attempts
        self.error(rec)
        self.consecutive_errors += 1
        if self.consecutive_errors >= self.cfg.max_consecutive_errors and self.abort is None:
            self.abort = (
                f"{self.consecutive_errors} samples failed in a row (--max-consecutive-errors "
                f"{self.cfg.max_consecutive_errors}); last: {reason}"
            )
            self.stop_event.set()

    # ------------------------------------------------------------------ stopping

    def pause_run(self, reason: DiskLow | DiskFullError) -> None:
        if isinstance(reason, DiskLow):
            self.reporter.free_bytes = reason.free  # the figure the pause message quotes
        if self.pause is None:
            self.pause = reason
            self.log(f"pausing: {reason}")
        self.stop_event.set()

    def fail(self, reason: str) -> None:
        if self.abort is None:
            self.abort = reason
        self.log(reason)
        self.stop_event.set()

    def writer_failed(self, e: BaseException) -> str:
        """The publishing side raised: a full disk (its bookkeeping's writes, errors.jsonl say) is
        a pause like any other; anything else a bug that fails the run. The reason, logged."""
        reason = f"the writer failed: {type(e).__name__}: {e}"
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            self.pause_run(e if isinstance(e, DiskFullError) else DiskFullError(e.errno, reason))
            return reason
        if self.abort is None:
            self.abort = reason
        self.log(reason)
        return reason

    def stopped_writing(self) -> bool:
        return self.abandon_event.is_set() or self.pause is not None

    # ------------------------------------------------------------------ outcomes

    def apply(self, work: Work, outcome: Outcome) -> None:
        """A published batch's outcome into the run: failed samples, the pause, the counters."""
        self.timings["writer_publish_s"] += outcome.publish_s
        self.guard.largest = max(self.guard.largest, outcome.largest)
        if outcome.last_free is not None:
            self.guard.last_free = outcome.last_free
        if outcome.free is not None:
            self.reporter.free_bytes = outcome.free
        by_id = {s.sample_id: s for s in work.samples}
        for sid, reason in outcome.failed:
            self.sample_failed(by_id[sid], reason)
        if outcome.pause is not None:
            self.pause_run(outcome.pause)
        for entry in outcome.written:
            self.reporter.add_written(entry.num_tokens, entry.size)
            self.reporter.free_bytes = (self.reporter.free_bytes or 0) - entry.size
            if self.bar is not None:
                self.bar.update(1)

    # ------------------------------------------------------------------ signals

    def install_signals(self) -> dict[int, Any]:
        """on_signal for SIGTERM and SIGINT (on the main thread only); the old handlers."""
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                handlers[sig] = signal.signal(sig, self.on_signal)
        return handlers

    @staticmethod
    def restore_signals(handlers: dict[int, Any]) -> None:
        for sig, old in handlers.items():
            signal.signal(sig, old)

    def on_signal(self, signum: int, _frame: Any) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
            self.log(f"{signal.Signals(signum).name}: finishing the batch in flight, then stopping")
            self.stop_event.set()
        else:
            self.log(f"{signal.Signals(signum).name} again: abandoning unwritten samples")
            self.abandon_event.set()
            if self.on_abandon is not None:
                self.on_abandon()

    # ------------------------------------------------------------------ status

    def refresh_free(self) -> None:
        """The status thread's tick: free bytes and the reserve as the guard sees them now."""
        try:
            self.reporter.free_bytes = self.guard.check(0) if self.pause is None else self.reporter.free_bytes
        except DiskLow as e:
            self.reporter.free_bytes = e.free
        with self.reporter.lock:
            self.reporter.reserve_bytes = self.guard.reserve

    def open_bar(self) -> ProgressLines | None:
        """The tqdm bar, or the progress lines (returned, started: the status thread ticks them),
        per --progress (extraction/runner/progress.py)."""
        mode = progress_mode(self.cfg.progress, sys.stderr.isatty())
        if mode == "lines":
            lines = ProgressLines(self.reporter, self.log, self.cfg.progress_interval)
            lines.start()
            return lines
        if mode == "off":
            return None
        from tqdm import tqdm

        self.bar = tqdm(
            total=self.reporter.total,
            initial=self.reporter.done,
            unit="sample",
            dynamic_ncols=True,
            smoothing=0.1,
        )
        return None

    def bar_postfix(self) -> None:
        snap = self.reporter.snapshot_rates()
        self.bar.set_postfix(tok_s=f"{snap[1]:.0f}", errors=self.reporter.errors, refresh=False)

    def no_valid_rows(self) -> str:
        """What a run whose every row was skipped says: the shapes a row must have, the first bad
        line, and that the same command resumes once the dataset is fixed."""
        cfg, first = self.cfg, self.first_row_error or {}
        where = f" for this node (--shard-index {cfg.shard_index} of {cfg.num_shards})" if cfg.num_shards > 1 else ""
        where = f" for this node (--assign {cfg.assign})" if cfg.assign is not None else where
        reason = str(first.get("reason", "?"))
        shapes = "" if ROW_SHAPES[0] in reason else f"; a row must be a JSON object with {' or '.join(ROW_SHAPES)}"
        again = "fix the dataset and run the same command again"
        if not self.reporter.row_errors:  # an empty file (or blank lines only)
            return f"no rows in {cfg.dataset}: the file holds none{shapes}; {again}"
        return (
            f"no valid rows in {cfg.dataset}{where}: {self.reporter.row_errors} row(s) skipped, each "
            f"in {os.path.join(cfg.output, ERRORS_NAME)}; first bad row: {cfg.dataset} line "
            f"{first.get('line', '?')}: {reason}{shapes}; {again} (rows that were errors are not "
            "results: they are read again)"
        )

    def exit_code(self) -> int:
        """The run's exit status; status.json's final state and message set (not written)."""
        r = self.reporter
        if self.abort is not None and self.pause is not None:
            # A failure beside a pause (a full disk's own failures are pauses: writer_failed): the
            # job unit restarts a failure and leaves a pause to a person, whose "free space" would
            # be the wrong advice. The restart finds the disk as it is and pauses again if need be.
            msg = f"{self.abort} (the run had also paused: {self.pause})"
            r.set_state("failed", msg)
            self.log(f"aborting: {msg}")
            return EXIT_FAILED
        if self.pause is not None:
            free = self.guard.last_free
            msg = (
                f"free {free} bytes < reserve {self.guard.reserve} bytes + next shard"
                if isinstance(self.pause, DiskLow)
                else f"disk full while writing ({self.pause}); free {free} bytes"
            )
            r.set_state(STATE_DISK_LOW, msg + "; free space and run again to resume")
            self.log(f"paused: {msg}; exit {EXIT_PAUSED}")
            return EXIT_PAUSED
        if self.stop_signal is not None:
            r.set_state("interrupted", f"stopped by {signal.Signals(self.stop_signal).name}")
            return EXIT_SIGINT if self.stop_signal == signal.SIGINT else EXIT_SIGTERM
        if self.abort is not None:
            r.set_state("failed", self.abort)
            self.log(f"aborting: {self.abort}")
            return EXIT_FAILED
        if r.total <= 0 and r.done == 0 and (r.row_errors or not self.cfg.partial):
            msg = self.no_valid_rows()
            r.set_state("failed", msg)
            self.log(msg)
            return EXIT_FAILED
        missing = r.total - r.done
        if missing > 0:
            msg = f"{missing} sample(s) failed (see {ERRORS_NAME}); run again to retry them"
            r.set_state("failed", msg)
            self.log(msg)
            return EXIT_FAILED
        r.set_state("done", f"{r.written} written, {r.skipped_existing} already there")
        return EXIT_OK  # the runner's closing line (progress.closing_line) says it
