# Copyright: (c) 2026, hsx maintainers
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The GPU health gate's active check: NVIDIA DCGM's diagnostic, ``dcgmi diag -r LEVEL -j``.

Contract:

- `run_diag(dcgmi, level, timeout)` runs the diagnostic in a session of its own (on timeout the whole
  session, dcgmi and the nvvs it starts, is sent SIGTERM, then SIGKILL) and returns a `DiagResult`:
  ``passed`` only when dcgmi exited 0 and no test says Fail; ``failed`` naming the tests that failed
  (and their first messages), or why the diagnostic could not run (its runtime error, its exit
  status and first output lines, or the timeout). A passing exit with a test that says Fail is a
  failure; so is a non-zero exit whatever the output says.
- `parse(text)` reads dcgmi's output: the JSON of ``-j`` (DCGM 4's ``"DCGM Diagnostic"`` with
  per-entity results and a ``test_summary``; DCGM 3's ``"DCGM GPU Diagnostic"`` with ``gpu_ids``;
  text before the first ``{`` is skipped) or, where the output is not JSON, the table dcgmi prints
  without ``-j`` (``| name | Pass |`` rows, ``| | GPU0: Fail |`` rows below). Statuses compare
  without case (DCGM 3 says FAIL, DCGM 4 Fail); Skip, Not Run and Warn are not failures (dcgmi's
  exit status still is).
- Levels: 1 (seconds: the deployment checks - driver, NVML, persistence, page retirement/row remap,
  inforom), 2 (about 2 minutes: adds the memory and PCIe tests; NVIDIA's "epilogue on failure"),
  3 and 4 (tens of minutes to hours, for an administrator). `DEFAULT_TIMEOUTS` bounds each.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field

DEFAULT_TIMEOUTS = {1: 300, 2: 900, 3: 3600, 4: 10800}
_ROOTS = ("DCGM Diagnostic", "DCGM GPU Diagnostic")  # DCGM 4, DCGM 3
_ENTITY_ROW = re.compile(r"([A-Za-z_]+[0-9]+): (Pass|Fail|Skip|Warn|Not Run)", re.IGNORECASE)


@dataclass
class DiagTest:
    """One test of the diagnostic: its overall status and each entity's ("GPU0: Fail")."""

    category: str
    name: str
    status: str
    entities: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.status.lower() == "fail" or any(e.lower().endswith(": fail") for e in self.entities)


@dataclass
class DiagResult:
    state: str  # "passed" or "failed"
    level: int
    message: str
    rc: int | None = None
    seconds: float = 0.0
    failed_tests: list[str] = field(default_factory=list)
    tests: list[DiagTest] = field(default_factory=list)


def _status(value: object) -> str:
    return str(value).strip().title() if value is not None else ""


def _entity(result: dict) -> str:
    if "entity_group" in result:
        return f"{result.get('entity_group')}{result.get('entity_id', '')}"
    ids = result.get("gpu_ids", result.get("gpu_id"))
    return f"GPU{ids}" if ids is not None else ""


def _messages(result: dict) -> list[str]:
    out = []
    for w in result.get("warnings") or []:
        # DCGM 3 named the message "warnings" in its deployment tests, "warning" elsewhere
        text = (w.get("warning") or w.get("warnings")) if isinstance(w, dict) else w
        if isinstance(text, str) and text.strip():
            out.append(" ".join(text.split())[:300])
    return out


def _from_json(doc: dict) -> tuple[list[DiagTest], str | None]:
    root = next((doc[k] for k in _ROOTS if isinstance(doc.get(k), dict)), None)
    if root is None:
        raise ValueError(f"no {' or '.join(repr(k) for k in _ROOTS)} object")
    error = root.get("runtime_error")
    tests = []
    for cat in root.get("test_categories") or []:
        for t in (cat.get("tests") or []) if isinstance(cat, dict) else []:
            if not isinstance(t, dict):
                continue
            results = [r for r in t.get("results") or [] if isinstance(r, dict)]
            summary = t.get("test_summary") if isinstance(t.get("test_summary"), dict) else {}
            entities = [f"{_entity(r)}: {_status(r.get('status'))}".lstrip(": ") for r in results]
            statuses = [_status(r.get("status")) for r in results]
            overall = _status(summary.get("status")) or ("Fail" if "Fail" in statuses else
                                                         statuses[0] if statuses else "")
            msgs = _messages(summary) or [m for r in results for m in _messages(r)]
            tests.append(DiagTest(str(cat.get("category", "")), str(t.get("name", "")), overall, entities, msgs))
    return tests, (str(error) if error else None)


def _from_table(text: str) -> list[DiagTest]:
    tests: list[DiagTest] = []
    category = ""
    continuing = False
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(("|-----", "+-----")):
            category = line.strip("|+- ").split(" ")[0].strip("- ")
            continue
        if not line.startswith("|") or line.count("|") < 3:
            continue
        name, value = (c.strip() for c in line.strip("|").split("|", 1))
        value = value.rstrip("|").strip()
        if name == "Diagnostic" or category == "Metadata":
            continue
        kind = name.split(":", 1)[0]
        if name and kind not in ("Warning", "Info"):
            tests.append(DiagTest(category, name, _status(value)))
        elif tests and not name and _ENTITY_ROW.fullmatch(value):
            entity, status = _ENTITY_ROW.fullmatch(value).groups()
            tests[-1].entities.append(f"{entity}: {_status(status)}")
            continuing = False
        elif tests and kind == "Warning":
            tests[-1].messages.append(value)
            continuing = True
        elif tests and not name and continuing:  # dcgmi wraps a message at 45 characters
            tests[-1].messages[-1] += value
        if name:
            continuing = kind == "Warning"
    return tests


def parse(text: str) -> tuple[list[DiagTest], str | None]:
    """(tests, runtime error or None) from dcgmi diag's output, JSON or table (see the contract).
    ValueError when it is neither."""
    start, end = text.find("{"), text.rfind("}")
    if start >= 0 and end > start:
        try:
            doc = json.loads(text[start:end + 1])
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            return _from_json(doc)
    tests = _from_table(text)
    if not tests:
        raise ValueError("neither dcgmi's JSON nor its result table")
    return tests, None


def judge(level: int, rc: int | None, text: str, seconds: float = 0.0) -> DiagResult:
    """The verdict on one run's exit status and output."""
    first = " / ".join(x.strip() for x in text.strip().splitlines()[:3])[:300] or "no output"
    try:
        tests, error = parse(text)
    except ValueError as e:
        tests, error = [], f"unreadable output ({e}): {first}"
    failed = [t for t in tests if t.failed]
    r = DiagResult("failed", level, "", rc, round(seconds, 1), [t.name for t in failed], tests)
    if failed:
        why = "; ".join(f"{t.name} ({', '.join(e for e in t.entities if e.endswith('Fail')) or t.status})"
                        + (f": {' '.join(t.messages[:2])}" if t.messages else "") for t in failed)
        r.message = f"dcgmi diag -r {level} failed: {why}"
    elif error:
        r.message = f"dcgmi diag -r {level} could not run: {error}"
    elif rc != 0:
        r.message = f"dcgmi diag -r {level} exited {rc} with no test failed: {first}"
    else:
        r.state = "passed"
        r.message = f"dcgmi diag -r {level} passed ({len(tests)} tests, {r.seconds} s)"
    return r


def run_diag(dcgmi: str, level: int, timeout: float | None = None) -> DiagResult:
    """Run ``dcgmi diag -r level -j`` and judge it (see the contract); `timeout` None: by level."""
    timeout = timeout or DEFAULT_TIMEOUTS.get(level, 3600)
    argv = [dcgmi, "diag", "-r", str(level), "-j"]
    started = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError as e:
        return DiagResult("failed", level, f"dcgmi diag -r {level} could not start: {e}")
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.communicate(timeout=wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        return DiagResult("failed", level, f"dcgmi diag -r {level} did not finish within {timeout:g} s (stopped): "
                          "a hung GPU or diagnostic", None, round(time.monotonic() - started, 1))
    return judge(level, proc.returncode, out.decode("utf-8", "replace"), time.monotonic() - started)
