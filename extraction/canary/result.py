"""The canary's verdict, its record and its exit status.

Contract:
- `CanaryResult.state` is one of STATES: `passed` (every sample's tokens equal and every state
  within the tolerance), `mismatch` (one is not: this node computes differently; `samples` say
  which and by how much), `skipped` (nothing to compare: no run.json or no indexed shard - a fresh
  run), `error` (the check could not be made: a bad input, a chosen shard missing or bad, a
  backend that does not start; `message` says what and where). Only `passed` and `skipped` let a
  job start.
- `exit_code`: 0 passed or skipped, EXIT_CANARY_MISMATCH (5) mismatch, the error's own otherwise
  (EXIT_USAGE 2: configuration or inputs; EXIT_FAILED 1: a shard or a backend).
- `write_record(result)`: OUTPUT/canary.json (CANARY_NAME), replaced atomically without following
  a link (hsx.fsutil.atomic_write_bytes; its temp is a writer temp, `.canary.json.<tag>.tmp`, which
  the job's start removes if a crash leaves one). The only file the canary writes; never for
  `skipped` (a fresh output stays as it was). A write that fails is said in `record_error`; the
  verdict stands.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from extraction.canary.compare import SampleCheck, _json_float
from hsx.exitcodes import EXIT_CANARY_MISMATCH, EXIT_FAILED, EXIT_OK
from hsx.fsutil import atomic_write_bytes
from hsx.status import now_iso

CANARY_NAME = "canary.json"
STATES = ("passed", "mismatch", "skipped", "error")


@dataclass
class CanaryResult:
    """One `hsx canary` run (see the module's contract)."""

    state: str
    message: str
    output: str
    requested: int = 0  # samples asked for (--samples)
    samples: list[SampleCheck] = field(default_factory=list)
    tolerance: float | None = None  # the largest bound a compared sample was held to
    batch_tolerance: float = 0.0  # the bound of samples re-run in their original batch
    fallback_tolerance: float | None = None  # the bound of samples re-run alone
    rebuilt: int = 0  # original batches rebuilt and forwarded
    forwarded: int = 0  # samples run through the model (the rebuilt batches' rows and the ones alone)
    batch_log: str = ""  # what OUTPUT/batches.jsonl held (check._describe_log)
    dtype: str | None = None
    backend: str | None = None
    device: str | None = None
    source: str = ""  # where the samples were chosen from (pick.Pick.source)
    candidates: int = 0
    seconds: float = 0.0  # the whole check
    model_load_s: float = 0.0
    forward_s: float = 0.0
    error_code: int = EXIT_FAILED  # the exit status of an `error`
    record: str | None = None  # the record's path, once written
    record_error: str | None = None
    at: str = field(default_factory=now_iso)

    @property
    def max_rel_error(self) -> float | None:
        """The worst relative error over the samples compared (None: none was)."""
        return max((s.max_rel_error for s in self.samples), default=None)

    @property
    def exit_code(self) -> int:
        if self.state in ("passed", "skipped"):
            return EXIT_OK
        return EXIT_CANARY_MISMATCH if self.state == "mismatch" else self.error_code

    def to_dict(self) -> dict[str, Any]:
        worst = self.max_rel_error
        return {
            "state": self.state,
            "message": self.message,
            "output": self.output,
            "host": socket.gethostname(),
            "at": self.at,
            "requested": self.requested,
            "checked": len(self.samples),
            "mismatched": [s.sample_id for s in self.samples if not s.ok],
            "bit_equal": sum(all(s.bit_equal.values()) and bool(s.bit_equal) for s in self.samples),
            "max_rel_error": None if worst is None else _json_float(worst),
            "tolerance": self.tolerance,
            "batch_tolerance": self.batch_tolerance,
            "fallback_tolerance": self.fallback_tolerance,
            "rebuilt_batches": self.rebuilt,
            "forwarded": self.forwarded,
            "batch_log": self.batch_log,
            "dtype": self.dtype,
            "backend": self.backend,
            "device": self.device,
            "chosen_from": self.source,
            "candidates": self.candidates,
            "seconds": round(self.seconds, 3),
            "model_load_seconds": round(self.model_load_s, 3),
            "forward_seconds": round(self.forward_s, 3),
            "exit_code": self.exit_code,
            "record": self.record,
            "record_error": self.record_error,
            "samples": [s.to_dict() for s in self.samples],
        }


def write_record(result: CanaryResult) -> None:
    """OUTPUT/canary.json (see the module's contract); sets `record` or `record_error`."""
    if result.state == "skipped":
        return
    path = os.path.join(result.output, CANARY_NAME)
    data = dict(result.to_dict(), record=path)
    try:
        atomic_write_bytes(path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode("utf-8"))
    except (OSError, ValueError) as e:
        result.record_error = f"cannot write {path}: {getattr(e, 'strerror', None) or e}"
        return
    result.record = path
