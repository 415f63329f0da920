"""The self-healing stack on the control node for tests/integration/test_self_healing.py: the real
Prometheus (Debian's), Alertmanager (Debian's prometheus-alertmanager) and ansible-rulebook, configured
from the project's own files - roles/monitoring/files/hsx-selfheal.rules.yml,
roles/monitoring/files/alertmanager-selfheal.yml, extensions/eda/rulebooks/selfheal.yml - with the lab's
shortened timings put in by exact replacement (each must match: a change of the shipped file fails here
instead of silently testing production timings)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from labctl import REPO, wait_for
from test_monitoring import SCRAPE_PARAMS, Prometheus, free_port

BIN = Path(sys.executable).parent
FILES = REPO / "roles" / "monitoring" / "files"
RULEBOOK = REPO / "extensions" / "eda" / "rulebooks" / "selfheal.yml"
SOURCES = REPO / "extensions" / "eda" / "plugins" / "event_source"

# The lab's timings (the production ones are in the shipped files; README, "Self-healing").
SCRAPE_S = 1
STALL_S = 30  # no shard for this long: stalled (production 300)
STALL_FOR_S = 3  # the alert's for: (production 1m)
MAX_FAILURES = 2  # failed automatic recoveries before a person is asked (production 3)
GROUP_WAIT_S = 1  # Alertmanager (production 10s)
REPEAT_S = 5  # Alertmanager re-posts a firing alert (production 15m)
WINDOW_S = 45  # the rulebook's once_within per host (production 15 minutes)
SETTLE_S = 2  # hsx selfheal remedy waits this long for other nodes' alerts (production 60 s)

RULE_EDITS = [
    ("(time() - hsx_last_progress_timestamp_seconds) > 300", f"(time() - hsx_last_progress_timestamp_seconds) > {STALL_S}"),
    ("for: 1m", f"for: {STALL_FOR_S}s"),
    ("for: 5m", "for: 5s"),
    ("hsx_recover_automatic_failures >= 3", f"hsx_recover_automatic_failures >= {MAX_FAILURES}"),
]
RULEBOOK_EDITS = [("once_within: 15 minutes", f"once_within: {WINDOW_S} seconds")]


def edited(text: str, edits: list[tuple[str, str]], what: str) -> str:
    """`text` with every (old, new) replaced; AssertionError naming `what` when an `old` is not there."""
    for old, new in edits:
        assert old in text, f"{what}: {old!r} not found (the shipped file changed: update selfheal_stack.py)"
        text = text.replace(old, new)
    return text


@dataclass
class Stack:
    """The running servers and where their files are."""

    dir: Path
    prometheus: Prometheus
    procs: list[subprocess.Popen] = field(default_factory=list)
    rulebook_log: Path | None = None

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _start(stack: Stack, name: str, argv: list[str], env: dict[str, str] | None = None) -> Path:
    log = stack.dir / f"{name}.log"
    with open(log, "wb") as out:
        stack.procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=stack.dir, env=env))
    return log


def control_node_exporter() -> Path:
    """The distribution's node_exporter of the lab hosts' rootfs (Debian's prometheus-node-exporter, a
    static binary), run on the control node for the loop's own textfile (hsx-selfheal.prom)."""
    found = sorted(Path(os.environ.get("HSX_LAB_CACHE", "/var/cache/hsx-lab")).glob("rootfs-*/usr/bin/prometheus-node-exporter"))
    assert found, "no lab rootfs with prometheus-node-exporter (make lab-ensure builds it)"
    return found[-1]


def start(d: Path, targets: dict[str, str], inventory: list[str], report_dir: Path,
          node_down_for_s: int | None = None, brakes: dict | None = None, scrape_loop: bool = False) -> Stack:
    """Prometheus scraping `targets` ({inventory name: address}; the name as the target label hsx_host),
    Alertmanager routing to the rulebook, and the rulebook, whose remedies read `inventory` (its
    sources: the lab's dynamic one first) and write their reports in `report_dir`. The node-down
    alert's `for:` (the takeover's window, production 10 minutes) is shortened only when
    `node_down_for_s` is given: a lab host's power cycle must not be taken for a dead node. `brakes`: the
    rulebook's hsx_selfheal_breaker_* / _flap_* settings where a test needs others than the defaults.
    `scrape_loop`: also a node_exporter on the control node reading the loop's textfile directory (`d`),
    so that HsxSelfHealBreakerOpen / HsxSelfHealHostHeld fire in this Prometheus."""
    am_port, prom_port, hook_port, loop_port = free_port(), free_port(), free_port(), free_port()
    rule_edits = RULE_EDITS + ([("for: 10m", f"for: {node_down_for_s}s")] if node_down_for_s else [])
    (d / "hsx-selfheal.rules.yml").write_text(
        edited((FILES / "hsx-selfheal.rules.yml").read_text(), rule_edits, "hsx-selfheal.rules.yml"))
    am = yaml.safe_load((FILES / "alertmanager-selfheal.yml").read_text())
    route = am["route"]["routes"][0]
    route.update(group_wait=f"{GROUP_WAIT_S}s", group_interval=f"{GROUP_WAIT_S}s", repeat_interval=f"{REPEAT_S}s")
    am["receivers"][1]["webhook_configs"][0]["url"] = f"http://127.0.0.1:{hook_port}/alerts"
    (d / "alertmanager.yml").write_text(yaml.safe_dump(am))
    (d / "prometheus.yml").write_text(json.dumps({
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        # The people's alerts too, as a site loads both (HsxCanaryMismatch: the canary scenario waits for it).
        "rule_files": [str(d / "hsx-selfheal.rules.yml"), str(FILES / "hsx.rules.yml")],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
        "scrape_configs": [{"job_name": "node", "params": SCRAPE_PARAMS, "static_configs": [
            {"targets": [f"{address}:9100"], "labels": {"hsx_host": name}} for name, address in targets.items()]}]
        + ([{"job_name": "selfheal", "params": {"collect[]": ["textfile"]},
             "static_configs": [{"targets": [f"127.0.0.1:{loop_port}"]}]}] if scrape_loop else []),
    }))
    (d / "selfheal.yml").write_text(edited(RULEBOOK.read_text(), RULEBOOK_EDITS, "selfheal.yml"))
    (d / "selfheal-vars.yml").write_text(yaml.safe_dump({"hsx_selfheal_port": hook_port,
                                                         "hsx_selfheal_report_dir": str(report_dir),
                                                         "hsx_selfheal_inventory": ":".join(inventory),
                                                         "hsx_selfheal_max_failures": MAX_FAILURES,
                                                         "hsx_selfheal_settle": SETTLE_S,
                                                         "hsx_selfheal_progress_window": STALL_S // 2,
                                                         "hsx_selfheal_state_dir": str(d / "selfheal-state"),
                                                         "hsx_selfheal_textfile_dir": str(d), **(brakes or {})}))
    # The rulebook's inventory (it copies it, and reads only the host names from it): a static list.
    (d / "rulebook-inventory.yml").write_text(yaml.safe_dump(
        {"all": {"children": {"extraction_nodes": {"hosts": {name: None for name in targets}}}}}))
    stack = Stack(d, Prometheus(f"http://127.0.0.1:{prom_port}"))
    if scrape_loop:
        _start(stack, "node-exporter", [str(control_node_exporter()), f"--web.listen-address=127.0.0.1:{loop_port}",
                                        "--collector.disable-defaults", "--collector.textfile",
                                        f"--collector.textfile.directory={d}"])
    _start(stack, "alertmanager", ["prometheus-alertmanager", f"--config.file={d / 'alertmanager.yml'}",
                                   f"--storage.path={d / 'am-data'}", f"--web.listen-address=127.0.0.1:{am_port}",
                                   "--cluster.listen-address="])
    env = dict(os.environ, HSX_PROJECT_DIR=str(REPO),
               ANSIBLE_INVENTORY=str(d / "rulebook-inventory.yml"), PATH=f"{BIN}:{os.environ['PATH']}",
               ANSIBLE_FORCE_COLOR="0", ANSIBLE_NOCOLOR="1")
    stack.rulebook_log = _start(stack, "rulebook", [str(BIN / "ansible-rulebook"), "-r", str(d / "selfheal.yml"),
                                                    "-S", str(SOURCES), "-E", "HSX_PROJECT_DIR,ANSIBLE_INVENTORY", "--vars", str(d / "selfheal-vars.yml")],
                                env=env)
    # Prometheus evaluates alerts every second, and resends a firing one that often, so that
    # Alertmanager never times it out between evaluations.
    _start(stack, "prometheus", ["prometheus", f"--config.file={d / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={d / 'prom-data'}", f"--web.listen-address=127.0.0.1:{prom_port}",
                                 f"--rules.alert.resend-delay={SCRAPE_S}s"])
    try:
        wait_for(stack.prometheus.ready, 60, f"Prometheus to start (log: {d / 'prometheus.log'})")
        wait_for(lambda: _listening(hook_port), 120, f"the rulebook's webhook (log: {stack.rulebook_log})")
    except AssertionError:
        stack.stop()
        raise
    return stack


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def runs(report_dir: Path, host: str) -> list[dict]:
    """The recoveries the rulebook ran that touched `host`: its per-host report of each, oldest first."""
    return [dict(json.loads(p.read_text()), _dir=p.parent.name) for p in sorted(report_dir.glob(f"*/{host}.json"))]


def alert_state(p: Prometheus, name: str, host: str) -> dict | None:
    """Prometheus's alert `name` for `host` (state pending or firing, activeAt), or None."""
    for a in p.api("alerts")["alerts"]:
        if a["labels"]["alertname"] == name and a["labels"].get("hsx_host") == host:
            return a
    return None

