"""status.json: what a run is doing, for people (`hsx status`), Ansible and plots.

Replaced atomically every few seconds, so a reader never sees half a file. Rates are measured
over this process's work only (not shards found at start), ETA from the recent rate.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import socket
import threading
import time
from typing import Any

from .fsutil import atomic_write_bytes, read_nofollow

STATUS_NAME = "status.json"
ERRORS_NAME = "errors.jsonl"
STATE_DISK_LOW = "paused: disk low"  # the job stopped itself for lack of space (exit EXIT_PAUSED)
STATE_DONE = "done"  # every planned sample written (or recorded as an error)
STATES = ("starting", "running", STATE_DONE, STATE_DISK_LOW, "failed", "interrupted")
HISTORY_MAX = 240  # (time, done) points; halved by dropping every other one when full


def now_iso(t: float | None = None) -> str:
    return _dt.datetime.fromtimestamp(t if t is not None else time.time(), _dt.UTC).isoformat(
        timespec="seconds"
    )


def write_json_atomic(path: str, data: dict[str, Any]) -> None:
    """Temp -> rename in the same directory. No fsync: status is refreshed every few seconds and
    a lost update after a power cut costs nothing (the index is the truth). The temp is the
    writers' own kind (fsutil.atomic_write_bytes: an unguessable name, created O_EXCL|O_NOFOLLOW;
    one a crash leaves is removed with the other orphan temps): its old name,
    `status.json.<pid>.tmp`, could be planted as a link for root to write through."""
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"), durable=False)


# status.json is read, never trusted: a crash, a bug or another user may have written it. What
# StatusReporter.snapshot writes is far below this (history is bounded to HISTORY_MAX points).
STATUS_MAX_BYTES = 1 << 20
_MAX_COUNT = 1 << 63  # counters and byte sizes: int64, as any writer of ours can reach
_PID_MAX = (1 << 22) - 1  # Linux's PID_MAX_LIMIT; 0 and negatives are process groups for kill()


class StatusError(ValueError):
    """status.json exists but cannot be used: the message names the file and says why."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -_MAX_COUNT < v < _MAX_COUNT


def _is_number(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _is_time_text(v: Any) -> bool:
    if not isinstance(v, str):
        return False
    try:
        _dt.datetime.fromisoformat(v).timestamp()
    except (ValueError, OverflowError, OSError):
        return False
    return True


def _is_history(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(p, list) and len(p) == 2 and _is_number(p[0]) and _is_int(p[1]) for p in v
    )


# The fields StatusReporter writes (and its runner's `extra`), and what each must be when present.
# A field of another type means the file is not what we wrote: the whole file is unreadable
# rather than half believed. Unknown fields are passed through (a newer writer's).
_FIELD_CHECKS: dict[str, tuple[str, Any]] = {
    **{k: ("a string", lambda v: isinstance(v, str)) for k in ("state", "message", "output", "model", "dataset")},
    **{
        k: ("an integer", _is_int)
        for k in ("done", "total", "written", "skipped_existing", "errors", "row_errors", "bytes_written",
                  "reserve_bytes", "shard_index", "num_shards")
    },
    "buckets": ("an integer or null", lambda v: v is None or _is_int(v)),
    "assign": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "free_bytes": ("an integer or null", lambda v: v is None or _is_int(v)),
    **{k: ("a finite number", _is_number) for k in ("samples_per_s", "tokens_per_s", "resume_seconds")},
    "eta_s": ("a finite number or null", lambda v: v is None or _is_number(v)),
    "pid": (f"a process id (1..{_PID_MAX})", lambda v: _is_int(v) and 0 < v <= _PID_MAX),
    "host": ("a string or null", lambda v: v is None or isinstance(v, str)),
    **{k: ("an ISO 8601 time", _is_time_text) for k in ("started_at", "updated_at")},
    "history": ("a list of [time, done] pairs", _is_history),
}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_status(raw: bytes, where: str = STATUS_NAME) -> dict[str, Any]:
    """status.json's bytes -> its dict, every known field of the type StatusReporter writes;
    StatusError (a ValueError naming `where` and the reason) for anything else."""
    if len(raw) > STATUS_MAX_BYTES:
        raise StatusError(f"{where}: over {STATUS_MAX_BYTES} bytes, far more than any status this code writes")
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:
        raise StatusError(f"{where}: not valid status JSON (nested too deeply)") from None
    except ValueError as e:  # incl. UnicodeDecodeError and JSONDecodeError
        raise StatusError(f"{where}: not valid JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise StatusError(f"{where}: not a JSON object (a JSON {type(data).__name__})")
    for key, (what, ok) in _FIELD_CHECKS.items():
        if key in data and not ok(data[key]):
            raise StatusError(f"{where}: field {key!r} must be {what}, got a JSON {_json_type(data[key])}")
    return data


def _json_type(v: Any) -> str:
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(v), "null"
    )


def read_status(output_dir: str) -> dict[str, Any]:
    """The status of one output, checked (see parse_status).

    Raises OSError when it cannot be read (FileNotFoundError: there is none; fsutil.LinkRefused,
    naming the file: a link or a FIFO there, neither followed nor waited on) and StatusError, a
    ValueError whose message names the file and says why, when its content is not a status this
    code writes: not UTF-8 or not JSON, nested too deeply, not an object, too big, a known field of
    the wrong type. Callers catch (OSError, ValueError) and treat the run's status as unknown.
    """
    path = os.path.join(output_dir, STATUS_NAME)
    raw = read_nofollow(path, STATUS_MAX_BYTES + 1)  # a link or a FIFO there: LinkRefused
    return parse_status(raw, path)


RUN_UNDER_WAY = ("starting", "running")


def process_gone(status: dict[str, Any]) -> bool:
    """status.json says a run is under way but its process is gone (`pid_alive` False): it crashed
    or was killed and left the file as it was. Such a file must not read as a live run."""
    return status.get("state") in RUN_UNDER_WAY and status.get("pid_alive") is False


def pid_alive(pid: Any, host: Any) -> bool | None:
    """True/False for a pid on this host; None when the run is on another host (cannot tell).

    A pid that is no process id (not a number, a bool, 0 or negative - kill() would signal a
    process group or every process -, above PID_MAX_LIMIT) is not alive."""
    if host not in (None, socket.gethostname()):
        return None
    if isinstance(pid, bool) or not isinstance(pid, int | str):
        return False
    try:
        n = int(pid)
    except ValueError:
        return False
    if not 0 < n <= _PID_MAX:
        return False
    try:
        os.kill(n, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
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


def format_eta(s: Any) -> str:
    """Seconds as `1h02m` or `3m07s`; `?` for anything but a number."""
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
        f"errors {status.get('errors', 0)}, skipped rows {status.get('row_errors', 0)}",
        f"  {status.get('samples_per_s', 0)} samples/s, {status.get('tokens_per_s', 0)} tokens/s, "
        f"ETA {format_eta(status.get('eta_s'))}",
        f"  written {_fmt_bytes(status.get('bytes_written'))}, free {_fmt_bytes(status.get('free_bytes'))} "
        f"(reserve {_fmt_bytes(status.get('reserve_bytes'))})",
        f"  pid {status.get('pid', '?')} on {status.get('host', '?')}: {alive_text}; "
        f"updated {status.get('updated_at', '?')}",
    ]
    split = split_text(status)
    if split:
        lines.insert(2, f"  split: {split}")
    return "\n".join(lines)


def split_text(status: dict[str, Any]) -> str:
    """Which part of the dataset this output's node runs: its buckets (--assign, issue #39) or
    its legacy shard; "" for the whole dataset."""
    if status.get("assign") is not None:
        return f"buckets {status['assign']} of {status.get('buckets', '?')} (this node's assignment)"
    if int(status.get("num_shards") or 1) > 1:
        return f"shard {status.get('shard_index', '?')} of {status['num_shards']} (--shard-index/--num-shards)"
    return ""


def summarize(statuses: list[dict[str, Any]]) -> dict[str, Any]:
    """Sums over several outputs (nodes splitting one dataset)."""
    keys = ("done", "total", "written", "skipped_existing", "errors", "row_errors", "bytes_written")
    total = {k: sum(int(s.get(k) or 0) for s in statuses) for k in keys}
    for k in ("samples_per_s", "tokens_per_s"):
        total[k] = round(sum(float(s.get(k) or 0) for s in statuses if s.get("state") == "running"), 3)
    remaining = max(total["total"] - total["done"], 0)
    total["eta_s"] = round(remaining / total["samples_per_s"], 1) if total["samples_per_s"] > 0 else None
    total["states"] = {s.get("output", "?"): s.get("state") for s in statuses}
    total["outputs"] = len(statuses)
    return total
