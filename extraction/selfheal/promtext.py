"""The self-healing loop's own state as Prometheus text (hsx-selfheal.prom), for node_exporter's
textfile collector on the control node: roles/monitoring/files/hsx-selfheal.rules.yml turns it into the
alerts that ask a person (HsxSelfHealBreakerOpen, HsxSelfHealHostHeld). Written whole, temp + rename."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hsx.fsutil import atomic_write_bytes

FILENAME = "hsx-selfheal.prom"


FREE_TEXT_CHARS = 300  # a why or a cause shown in an alert: one line, clipped


def escape_label(value: str) -> str:
    """`value` as a Prometheus text-format label value (between its double quotes): backslash,
    double quote and newline escaped, as the exposition format says; nothing else changed."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _label(value: object) -> str:
    """A free-text label of ours (a why, a cause, hosts): flattened to one line and clipped to
    FREE_TEXT_CHARS, then escaped (clipped after, an escape could be cut in two)."""
    return escape_label(str(value).replace("\n", " ")[:FREE_TEXT_CHARS])


def render(state: dict[str, Any], now: float) -> str:
    b = state.get("breaker")
    lines = [
        "# HELP hsx_selfheal_breaker_open 1 while the self-healing circuit breaker holds every automatic remedy "
        "(a person resumes it: hsx selfheal resume).",
        "# TYPE hsx_selfheal_breaker_open gauge",
    ]
    if b:
        lines.append(f'hsx_selfheal_breaker_open{{cause="{_label(b.get("cause", "unknown"))}",'
                     f'hosts="{_label(",".join(b.get("hosts", [])))}",alerts="{_label(",".join(b.get("alerts", [])))}",'
                     f'why="{_label(b.get("why", ""))}"}} 1')
    else:
        lines.append("hsx_selfheal_breaker_open 0")
    lines += [
        "# HELP hsx_selfheal_breaker_opened_timestamp_seconds When the open breaker opened (0: closed).",
        "# TYPE hsx_selfheal_breaker_opened_timestamp_seconds gauge",
        f"hsx_selfheal_breaker_opened_timestamp_seconds {float(b['opened_at']) if b else 0.0:.3f}",
        "# HELP hsx_selfheal_host_held 1 for a host self-healing leaves to a person (flapping, or failed in a row).",
        "# TYPE hsx_selfheal_host_held gauge",
    ]
    for host, held in sorted(state.get("held", {}).items()):
        lines.append(f'hsx_selfheal_host_held{{hsx_host="{_label(host)}",why="{_label(held.get("why", ""))}"}} 1')
    lines += [
        "# HELP hsx_selfheal_host_retired 1 for a host whose work the loop took over: its alerts act no more.",
        "# TYPE hsx_selfheal_host_retired gauge",
    ]
    for host in sorted(state.get("retired", {})):
        lines.append(f'hsx_selfheal_host_retired{{hsx_host="{_label(host)}"}} 1')
    lines += [
        "# HELP hsx_selfheal_ledger_timestamp_seconds When the self-healing ledger was last written.",
        "# TYPE hsx_selfheal_ledger_timestamp_seconds gauge",
        f"hsx_selfheal_ledger_timestamp_seconds {now:.3f}",
    ]
    return "\n".join(lines) + "\n"


def write(textfile_dir: str | os.PathLike[str] | None, state: dict[str, Any], now: float) -> None:
    if not textfile_dir:
        return
    # Readable by node_exporter (its own user) from the moment it has the name: the temp is made 0644.
    atomic_write_bytes(str(Path(textfile_dir) / FILENAME), render(state, now).encode(), durable=False, mode=0o644)
