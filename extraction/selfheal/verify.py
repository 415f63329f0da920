"""Before self-healing acts, it checks the alert's claim itself (extensions/eda/playbooks/selfheal_verify.yml):

- a recovery's claim - the host's job is not making progress - holds when the job's status, read over
  SSH, says it is not (failed, stale, its process gone); a job that makes progress is left alone;
- a takeover's claim - the node is down - holds only when neither SSH from the control node nor its
  node_exporter answers; the other nodes' answers say whether the rest of the fleet is healthy.

So a stale, spurious or forged alert never runs a remedy on a healthy node. The finding's first word
is its category (hsx.selfheal.policy FINDING_*); a verification that could not run is "unverified",
and on doubt the loop holds.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extraction.selfheal.policy import (
    FINDING_CONFIRMED,
    FINDING_NOT_CONFIRMED,
    FINDING_STORAGE,
    FINDING_UNREACHABLE,
    FINDING_UNVERIFIED,
)
from hsx.status import STATE_DISK_LOW, STATE_DONE


@dataclass(frozen=True)
class Verification:
    finding: str  # "<category>: <what was seen>"
    unanswering: list[str] = field(default_factory=list)  # extraction nodes that did not answer (takeover)

    @property
    def category(self) -> str:
        return self.finding.split(":", 1)[0]


def judge(result: dict[str, Any]) -> Verification:
    """The finding of one result of extensions/eda/playbooks/selfheal_verify.yml (pure; unit-tested)."""
    host = result.get("host", "?")
    if result.get("claim") == "takeover":
        nodes, answering = result.get("nodes") or [], result.get("answering") or []
        unanswering = [h for h in nodes if h not in answering]
        if result.get("answers"):
            return Verification(f"{FINDING_NOT_CONFIRMED}: {host} answers over SSH", unanswering)
        if result.get("exporter_up"):
            return Verification(f"{FINDING_NOT_CONFIRMED}: {host}'s node_exporter answers", unanswering)
        return Verification(f"{FINDING_UNREACHABLE}: {host} answers neither SSH nor its node_exporter", unanswering)
    if not result.get("answers"):
        return Verification(f"{FINDING_UNREACHABLE}: {host} does not answer over SSH")
    status, storage = result.get("status") or {}, result.get("storage") or {}
    if storage.get("probed") and not storage.get("writable"):  # first: such storage fails the status read too
        return Verification(f"{FINDING_STORAGE}: the output on {host} is not writable: {storage.get('error') or '?'}")
    if result.get("error"):
        return Verification(f"{FINDING_UNVERIFIED}: {host}'s job could not be read: {result['error']}")
    if result.get("status_read") is False:  # it answered the ping, then not (the play went on without it)
        return Verification(f"{FINDING_UNVERIFIED}: {host}'s job status was not read (it stopped answering)")
    if status.get("state") == STATE_DISK_LOW:  # the job's own reading: a full disk still lets the probe's empty file in
        return Verification(f"{FINDING_STORAGE}: the output on {host} is full (its job paused: {status.get('msg') or '?'})")
    if status.get("state") == STATE_DONE:  # a finished run needs no recovery (a stale alert: another output's metrics)
        return Verification(f"{FINDING_NOT_CONFIRMED}: {host}'s job is done ({status.get('done')} of "
                            f"{status.get('total')}): nothing to recover")
    age, uptime = status.get("status_age_s"), status.get("uptime_s")
    if isinstance(age, int | float) and isinstance(uptime, int | float) and age > uptime:
        return Verification(f"{FINDING_CONFIRMED}: {host}'s job status predates the host's boot "
                            f"({age:.0f} s old, up {uptime:.0f} s): no job of this boot runs")
    if status.get("making_progress"):
        return Verification(f"{FINDING_NOT_CONFIRMED}: {host}'s job is making progress "
                            f"(state {status.get('state')}, {status.get('done')} done)")
    return Verification(f"{FINDING_CONFIRMED}: {host}'s job is not making progress (state {status.get('state')}, "
                        f"process {'alive' if status.get('pid_alive') else 'gone'})")


def _plain(env: dict[str, str]) -> dict[str, str]:
    """`env` without what ansible-rulebook's runner sets for its own playbook (an event-stream stdout
    callback: base64 and terminal codes), so that a failed verification's output tail reads as text."""
    drop = ("ANSIBLE_STDOUT_CALLBACK", "ANSIBLE_CALLBACK_PLUGINS", "ANSIBLE_CALLBACKS_ENABLED", "AWX_", "RUNNER_")
    plain = {k: v for k, v in env.items() if not k.startswith(drop)}
    return dict(plain, ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0")


def verify(project_dir: Path | None, inventories: list[str], host: str, claim: str, *, env: dict[str, str],
           playbook: str, exporter_port: int = 9100, progress_window_s: int = 120,
           timeout_s: float = 300) -> Verification:
    """Run the verification play (`playbook`: a checkout's extensions/eda/playbooks/selfheal_verify.yml, or
    the installed collection's hsx.recovery.selfheal_verify) on the real inventory, in `project_dir` (a
    checkout; None: here), and judge its result."""
    with tempfile.TemporaryDirectory(prefix="hsx-selfheal-verify.") as d:
        out = Path(d) / "result.json"
        argv = ["ansible-playbook", playbook, *[a for inv in inventories for a in ("-i", inv)],
                "-e", json.dumps({"hsx_verify_claim": claim, "hsx_verify_host": host, "hsx_verify_result": str(out),
                                  "hsx_verify_exporter_port": exporter_port,
                                  "hsx_verify_progress_window": progress_window_s})]
        try:
            run = subprocess.run(argv, cwd=project_dir, env=_plain(env), capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return Verification(f"{FINDING_UNVERIFIED}: the verification play did not run: {exc}")
        try:
            result = json.loads(out.read_text())
        except (OSError, ValueError):
            tail = (run.stdout + run.stderr).strip().splitlines()[-5:]
            return Verification(f"{FINDING_UNVERIFIED}: the verification play wrote no result (rc {run.returncode}): "
                                + " | ".join(tail))
    return judge(result)
