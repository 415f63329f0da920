"""The recovery report: per-host JSON and a summary.md for people, from what the roles found.

recover.yml (and `hsx recover`) dump each host's role results to `REPORT/facts/<host>.json`;
this module turns them into `REPORT/<host>.json` ({"host", "ok", "checks", "before", "after",
...}) and `REPORT/summary.md`. One place decides what "ok" means for each stage, so the
playbook's report and the CLI's report can never disagree.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from extraction.fleet.takeoverreport import takeover_check, takeover_lines
from hsx.redact import redact_tree
from hsx.status import process_gone

FACTS_DIR = "facts"
HOSTS_FILE = "hosts.json"
SUMMARY = "summary.md"
# Stage order, as recover.yml runs them; a failed task's role prefix names its stage.
STAGES = [
    ("assess", "node_assess"),
    ("gpus", "gpu_reclaim"),
    ("storage", "storage_guard"),
    ("shards", "shard_verify"),
    ("deploy", "extraction_deploy"),
    ("patch", "sglang_patch"),
    ("server", "sglang_server"),
    ("job", "extraction_job"),
]


def _get(d: Any, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def _int(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError, OverflowError):  # OverflowError: Infinity in a facts file
        return None


def quarantined_count(shards: Any) -> tuple[int, bool]:
    """(how many shards shard_verify quarantined, whether that is a lower bound) from its result.

    The module's lists stop at its `max_listed`; its counts do not. Its `quarantined_count` is the
    answer; a result without one (a module from before it) has only the list, and when the `bad`
    list is visibly cut (shorter than bad_count) and the quarantined list is as long as it, that
    list was cut at the same cap: at least that many, and as many as were bad to move."""
    if not isinstance(shards, dict):
        return 0, False
    given = shards.get("quarantined_count")
    if not isinstance(given, bool) and (count := _int(given)) is not None:
        return count, False
    listed = shards.get("quarantined")
    listed_n = len(listed) if isinstance(listed, list) else 0
    bad_listed = shards.get("bad")
    cap = len(bad_listed) if isinstance(bad_listed, list) else None
    bad = _int(shards.get("bad_count")) or 0
    cut = cap is not None and 0 < cap < bad and listed_n >= cap
    return listed_n, cut


def stage_of_task(task_name: str | None) -> str | None:
    """'storage_guard : The data mount must be mounted' -> 'storage'."""
    if not task_name:
        return None
    role = task_name.split(" : ", 1)[0].strip() if " : " in task_name else ""
    for stage, role_name in STAGES:
        if role == role_name:
            return stage
    return None


def _progress(status: dict | None) -> dict[str, Any]:
    status = status or {}
    return {
        "state": status.get("state"),
        "done": _int(status.get("done")),
        "total": _int(status.get("total")),
        "samples_per_s": status.get("samples_per_s"),
        "making_progress": status.get("making_progress"),
        "process_gone": process_gone(status),
    }


def _checks(f: dict[str, Any]) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = []

    def add(name: str, ok: bool, detail: str) -> None:
        checks.append({"name": name, "ok": bool(ok), "detail": detail})

    assess = f.get("node_assess_report")
    if assess:
        running = assess.get("units_running") or []
        add(
            "assess",
            True,
            f"units running: {', '.join(running) or 'none'}; data mount "
            f"{'mounted' if _get(assess, 'data_mount', 'mounted') else 'NOT mounted'}",
        )
    gpu = f.get("gpu_reclaim_result")
    if gpu:
        changed = gpu.get("units_changed") or []
        ended = gpu.get("processes_ended") or []
        add(
            "gpus",
            not gpu.get("failed"),
            f"{len(gpu.get('units_running') or [])} units held the node "
            f"({', '.join(gpu.get('units_running') or []) or 'none'}); changed {', '.join(changed) or 'nothing'}; "
            f"{len(ended)} GPU processes ended; {gpu.get('gpus', 0)} GPUs",
        )
    health = f.get("gpu_reclaim_health_result")
    if isinstance(health, dict):
        findings = [x.get("message", "") for x in health.get("findings") or [] if isinstance(x, dict)]
        add("gpu health", health.get("passed") is not False,
            "; ".join(findings) or health.get("msg") or "passed")
    storage = f.get("storage_guard_result")
    if storage:
        add(
            "storage",
            True,
            f"{_int(storage.get('free_bytes'))} bytes free on {storage.get('mount')}, need "
            f"{_int(storage.get('need_bytes'))} for {storage.get('remaining_samples')} remaining samples"
            + (f"; {(storage.get('dumps') or {}).get('message')}" if isinstance(storage.get("dumps"), dict) else ""),
        )
    shards = f.get("shard_verify_result")
    if shards and not shards.get("skipped"):
        bad = _int(shards.get("bad_count")) or 0
        quarantined, at_least = quarantined_count(shards)
        missing = _int(shards.get("missing_count")) or 0
        ok = bad == 0 or quarantined >= bad or at_least or bool(shards.get("report_only"))
        add(
            "shards",
            ok,
            f"{shards.get('level')}: {shards.get('ok')} ok, {bad} bad, {missing} missing, "
            f"{'at least ' if at_least else ''}{quarantined} quarantined, "
            f"{shards.get('orphans_removed', 0)} temp files removed",
        )
    deploy = f.get("extraction_deploy_result")
    if deploy:
        add(
            "deploy",
            True,
            f"hsx {deploy.get('version')} in {deploy.get('venv')} "
            f"({'installed' if deploy.get('installed') else 'already current'})",
        )
    patch = f.get("sglang_patch_result")
    if patch:
        # sglang_patch_result: before/after are the file's patch state, state is present/absent.
        after = patch.get("after", patch.get("state_after"))
        wanted = "unpatched" if patch.get("state") == "absent" else "patched"
        add(
            "patch",
            after in (None, wanted) or bool(patch.get("check_mode")),
            f"SGLang {patch.get('version')}: {patch.get('before', patch.get('state_before', '?'))} -> {after or '?'}"
            + (f" (patch v{patch.get('patch_version')})" if patch.get("patch_version") else ""),
        )
    server = f.get("sglang_server_result")
    if server:
        add(
            "server",
            bool(server.get("healthy", True)) or bool(server.get("check_mode")) or server.get("start_requested") is False,
            f"{server.get('unit')}: {server.get('active_state', server.get('state', '?'))}",
        )
    job = f.get("extraction_job_result")
    if job:
        state = job.get("state")
        ok = (
            bool(job.get("making_progress"))
            or state == "done"
            or f.get("mode") == "check"
            or job.get("start_requested") is False
        )
        add(
            "job",
            ok,
            f"{job.get('unit')}: {job.get('active_state')}, {state}, "
            f"{job.get('done')}/{job.get('total')} done, {job.get('samples_per_s')} samples/s"
            + ("" if not job.get("message") else f" ({job.get('message')})"),
        )
    takeover = takeover_check(f)
    if takeover is not None:
        add("takeover", *takeover)
    rollout = f.get("rollout_result")
    if rollout:
        outcome = str(rollout.get("outcome") or "?")
        add("rollout", not outcome.startswith(("reverted", "REVERT", "not reached")),
            f"v{rollout.get('from_version')} -> v{rollout.get('to_version')}: {outcome}; "
            f"runs v{rollout.get('running_version')}")
    if f.get("failed_task"):
        stage = f.get("failed_stage") or stage_of_task(f.get("failed_task")) or "recover"
        add(stage, False, f"{f.get('failed_task')}: {f.get('failed_msg')}")
    return checks


def host_report(facts: dict[str, Any]) -> dict[str, Any]:
    """One host's report from the facts recover.yml dumped for it."""
    checks = _checks(facts)
    failed_stage = None
    if facts.get("failed_task"):
        failed_stage = facts.get("failed_stage") or stage_of_task(facts.get("failed_task")) or "recover"
    ok = not facts.get("failed_task") and all(c["ok"] for c in checks)
    before = {
        "progress": _progress(facts.get("status_before")),
        "units_running": _get(facts, "node_assess_report", "units_running", default=[]),
        "data_mount": _get(facts, "node_assess_report", "data_mount", default={}),
    }
    job = facts.get("extraction_job_result") or {}
    after = {
        "progress": _progress(facts.get("status_after")),
        "job": {
            k: job.get(k)
            for k in ("unit", "active_state", "state", "started", "restarted", "making_progress")
        },
        "shards_quarantined": quarantined_count(facts.get("shard_verify_result"))[0],
        "units_changed": _get(facts, "gpu_reclaim_result", "units_changed", default=[]),
        "processes_ended": len(_get(facts, "gpu_reclaim_result", "processes_ended", default=[]) or []),
        "patch": facts.get("sglang_patch_result"),
        "rollout": facts.get("rollout_result"),
        "takeover": facts.get("takeover"),
    }
    return {
        "host": facts.get("host"),
        "ok": ok,
        "mode": facts.get("mode", "apply"),
        "failed_step": failed_stage if not ok and facts.get("failed_task") else None,
        "reason": facts.get("failed_msg") if facts.get("failed_task") else None,
        "checks": checks,
        "before": before,
        "after": after,
    }


def unreachable_report(host: str) -> dict[str, Any]:
    return {
        "host": host,
        "ok": False,
        "mode": None,
        "failed_step": "connect",
        "reason": "unreachable (no facts came back from this host)",
        "checks": [{"name": "connect", "ok": False, "detail": "host unreachable"}],
        "before": {},
        "after": {},
    }


def _fmt_progress(p: dict[str, Any]) -> str:
    if not p or p.get("done") is None:
        return "-"
    total = p.get("total")
    state = (p.get("state") or "-") + (", process gone" if p.get("process_gone") else "")
    return f"{p['done']}/{total if total is not None else '?'} ({state})"


def summary_markdown(reports: list[dict[str, Any]], title: str) -> str:
    ok = [r for r in reports if r["ok"]]
    lines = [
        f"# {title}",
        "",
        f"{len(ok)} of {len(reports)} hosts ok.",
        "",
        "| host | ok | samples before | samples after | shards ok / quarantined | units stopped | "
        "GPU processes ended | patch | job |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        checks = {c["name"]: c for c in r["checks"]}
        shards = checks.get("shards", {}).get("detail", "-")
        after = r.get("after") or {}
        job = after.get("job") or {}
        patch = after.get("patch") or {}
        rollout = after.get("rollout") or {}
        patch_cell = (f"v{rollout.get('running_version')}" if rollout
                      else patch.get("after", patch.get("state_after", "-")) if patch else "-")
        lines.append(
            f"| {r['host']} | {'yes' if r['ok'] else '**NO**'} | {_fmt_progress(_get(r, 'before', 'progress'))} | "
            f"{_fmt_progress(_get(r, 'after', 'progress'))} | {shards} | "
            f"{', '.join(after.get('units_changed') or []) or '-'} | {after.get('processes_ended', 0) or 0} | "
            f"{patch_cell} | "
            f"{job.get('active_state') or '-'}, {job.get('state') or '-'} |"
        )
    rollouts = [r for r in reports if (r.get("after") or {}).get("rollout")]
    if rollouts:
        lines += ["", "## Patch versions", ""]
        for r in rollouts:
            ro = r["after"]["rollout"]
            lines.append(f"- {r['host']}: runs v{ro.get('running_version')} ({ro.get('outcome')}; "
                         f"was v{ro.get('from_version')}, target v{ro.get('to_version')})")
        halted = next((r["after"]["rollout"] for r in rollouts if r["after"]["rollout"].get("halted")), None)
        if halted:
            lines += ["", f"The rollout stopped: {halted.get('halt_reason')}."]
    lines += takeover_lines(reports)
    failed = [r for r in reports if not r["ok"]]
    if failed:
        lines += ["", "## Failed hosts", ""]
        for r in failed:
            lines.append(
                f"- **{r['host']}**: step `{r.get('failed_step') or '?'}`: {r.get('reason') or ''}".rstrip()
            )
            for c in r["checks"]:
                if not c["ok"]:
                    lines.append(f"  - {c['name']}: {c['detail']}")
    lines += ["", "## Checks per host", ""]
    for r in reports:
        lines.append(f"### {r['host']}")
        for c in r["checks"]:
            lines.append(f"- [{'x' if c['ok'] else ' '}] {c['name']}: {c['detail']}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def write_private(path: Path, text: str) -> None:
    """`text` into `path`, readable by its owner only: a new 0600 file renamed over the old one (so
    an earlier world-readable file, or a symlink, is replaced, never written through)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o600)  # whatever the umask
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def build(report_dir: str | os.PathLike, title: str = "Recovery report") -> tuple[list[dict[str, Any]], Path]:
    """Read REPORT/facts/*.json (+ hosts.json for the hosts that should be there), write the reports
    (0600, redacted: docs/security.md)."""
    root = Path(report_dir)
    facts_dir = root / FACTS_DIR
    if not root.is_dir():
        what = "not a directory" if root.exists() else "no such directory"
        raise FileNotFoundError(
            f"{root}: {what}: give the reports/<timestamp> directory a recovery wrote (ls reports/)"
        )
    if not facts_dir.is_dir() and not (root / HOSTS_FILE).is_file():
        raise FileNotFoundError(
            f"{root} holds no {FACTS_DIR}/ or {HOSTS_FILE}: not a recovery report directory"
        )
    facts = {}
    for path in sorted(facts_dir.glob("*.json")) if facts_dir.is_dir() else []:
        data = redact_tree(json.loads(path.read_text()))
        facts[data.get("host") or path.stem] = data
    expected = json.loads((root / HOSTS_FILE).read_text()) if (root / HOSTS_FILE).is_file() else sorted(facts)
    reports = []
    for host in expected:
        report = host_report(facts[host]) if host in facts else unreachable_report(host)
        write_private(root / f"{host}.json", json.dumps(report, indent=2, sort_keys=True) + "\n")
        reports.append(report)
    summary = root / SUMMARY
    write_private(summary, summary_markdown(reports, title))
    return reports, summary
