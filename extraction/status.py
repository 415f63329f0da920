"""status.json: what a run is doing, for people (`hsx status`), Ansible and plots.

Replaced atomically every few seconds, so a reader never sees half a file. Rates are measured
over this process's work only (not shards found at start), ETA from the recent rate.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import threading
import time
from typing import Any

STATUS_NAME = "status.json"
ERRORS_NAME = "errors.jsonl"
STATES = ("starting", "running", "done", "paused: disk low", "failed", "interrupted")
HISTORY_MAX = 240  # (time, done) points; halved by dropping every other one when full


def now_iso(t: float | None = None) -> str:
    return _dt.datetime.fromtimestamp(t if t is not None else time.time(), _dt.UTC).isoformat(
        timespec="seconds"
    )


def write_json_atomic(path: str, data: dict[str, Any]) -> None:
    """Temp -> rename in the same directory. No fsync: status is refreshed every few seconds and
    a lost update after a power cut costs nothing (the index is the truth)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def read_status(output_dir: str) -> dict[str, Any]:
    """The status of one output; OSError/ValueError when missing or unreadable."""
    with open(os.path.join(output_dir, STATUS_NAME), encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{output_dir}/{STATUS_NAME} is not a JSON object")
    return data


RUN_UNDER_WAY = ("starting", "running")


def process_gone(status: dict[str, Any]) -> bool:
    """status.json says a run is under way but its process is gone (`pid_alive` False): it crashed
    or was killed and left the file as it was. Such a file must not read as a live run."""
    return status.get("state") in RUN_UNDER_WAY and status.get("pid_alive") is False


def pid_alive(pid: Any, host: Any) -> bool | None:
    """True/False for a pid on this host; None when the run is on another host (cannot tell)."""
    if host not in (None, socket.gethostname()):
        return None
    try:
        os.kill(int(pid), 0)
    except (TypeError, ValueError):
        return False
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StatusReporter:
    """Holds the run's counters; `write()` renders status.json. Thread-safe counters."""

    def __init__(self, output_dir: str, total: int, skipped_existing: int, reserve_bytes: int):
        self.path = os.path.join(output_dir, STATUS_NAME)
        self.output_dir = output_dir
        self.lock = threading.Lock()
        self.state = "starting"
        self.message = ""
        self.total = total
        self.skipped_existing = skipped_existing
        self.written = 0
        self.tokens = 0
        self.bytes_written = 0
        self.errors = 0
        self.row_errors = 0
        self.reserve_bytes = reserve_bytes
        self.free_bytes: int | None = None
        self.started = time.time()
        self.work_started: float | None = None
        self.history: list[tuple[float, int]] = []
        self.extra: dict[str, Any] = {}

    @property
    def done(self) -> int:
        return self.skipped_existing + self.written

    def add_written(self, tokens: int, nbytes: int) -> None:
        with self.lock:
            if self.work_started is None:
                self.work_started = time.time()
            self.written += 1
            self.tokens += tokens
            self.bytes_written += nbytes

    def add_error(self) -> None:
        with self.lock:
            self.errors += 1

    def set_state(self, state: str, message: str = "") -> None:
        with self.lock:
            self.state = state
            self.message = message

    def snapshot_rates(self) -> tuple[float, float]:
        """(samples/s, tokens/s) over this process's writes."""
        with self.lock:
            if not self.written or self.work_started is None:
                return 0.0, 0.0
            elapsed = max(time.time() - self.work_started, 1e-9)
            return self.written / elapsed, self.tokens / elapsed

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            now = time.time()
            self.history.append((round(now, 1), self.done))
            if len(self.history) > HISTORY_MAX:
                self.history = self.history[::2] + ([self.history[-1]] if len(self.history) % 2 == 0 else [])
            start = self.work_started or now
            elapsed = max(now - start, 1e-9)
            sps = self.written / elapsed if self.written else 0.0
            tps = self.tokens / elapsed if self.written else 0.0
            remaining = max(self.total - self.done, 0)
            eta = remaining / sps if sps > 0 else None
            return {
                "state": self.state,
                "message": self.message,
                "done": self.done,
                "total": self.total,
                "written": self.written,
                "skipped_existing": self.skipped_existing,
                "errors": self.errors,
                "row_errors": self.row_errors,
                "samples_per_s": round(sps, 3),
                "tokens_per_s": round(tps, 1),
                "eta_s": round(eta, 1) if eta is not None else None,
                "bytes_written": self.bytes_written,
                "free_bytes": self.free_bytes,
                "reserve_bytes": self.reserve_bytes,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "output": os.path.abspath(self.output_dir),
                "started_at": now_iso(self.started),
                "updated_at": now_iso(now),
                "history": [list(p) for p in self.history],
                **self.extra,
            }

    def write(self) -> dict[str, Any]:
        data = self.snapshot()
        try:
            write_json_atomic(self.path, data)
        except OSError:
            pass  # a full disk must not crash the run over its status file; the index is the truth
        return data


class StatusThread(threading.Thread):
    """Rewrites status.json every `interval` seconds until stopped."""

    def __init__(self, reporter: StatusReporter, interval: float, on_tick: Any = None):
        super().__init__(name="hsx-status", daemon=True)
        self.reporter = reporter
        self.interval = interval
        self.on_tick = on_tick
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            if self.on_tick:
                self.on_tick()
            self.reporter.write()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)


# ---------------------------------------------------------------- `hsx status` rendering


def _fmt_bytes(n: Any) -> str:
    if not isinstance(n, int | float):
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "?"


def _fmt_eta(s: Any) -> str:
    if not isinstance(s, int | float):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def describe(status: dict[str, Any]) -> str:
    """A few lines for a person."""
    alive = status.get("pid_alive")
    alive_text = {True: "alive", False: "NOT running", None: "on another host"}.get(alive, "?")
    done, total = status.get("done", 0), status.get("total", 0)
    pct = f" ({100 * done / total:.1f}%)" if total else ""
    lines = [
        f"{status.get('output', '?')}: {status.get('state', '?')}"
        + (f" - {status['message']}" if status.get("message") else ""),
        f"  done {done}/{total}{pct}, skipped existing {status.get('skipped_existing', 0)}, "
        f"errors {status.get('errors', 0)}",
        f"  {status.get('samples_per_s', 0)} samples/s, {status.get('tokens_per_s', 0)} tokens/s, "
        f"ETA {_fmt_eta(status.get('eta_s'))}",
        f"  written {_fmt_bytes(status.get('bytes_written'))}, free {_fmt_bytes(status.get('free_bytes'))} "
        f"(reserve {_fmt_bytes(status.get('reserve_bytes'))})",
        f"  pid {status.get('pid', '?')} on {status.get('host', '?')}: {alive_text}; "
        f"updated {status.get('updated_at', '?')}",
    ]
    return "\n".join(lines)


def summarize(statuses: list[dict[str, Any]]) -> dict[str, Any]:
    """Sums over several outputs (nodes splitting one dataset)."""
    keys = ("done", "total", "written", "skipped_existing", "errors", "bytes_written")
    total = {k: sum(int(s.get(k) or 0) for s in statuses) for k in keys}
    for k in ("samples_per_s", "tokens_per_s"):
        total[k] = round(sum(float(s.get(k) or 0) for s in statuses if s.get("state") == "running"), 3)
    remaining = max(total["total"] - total["done"], 0)
    total["eta_s"] = round(remaining / total["samples_per_s"], 1) if total["samples_per_s"] > 0 else None
    total["states"] = {s.get("output", "?"): s.get("state") for s in statuses}
    total["outputs"] = len(statuses)
    return total
