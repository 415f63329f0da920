"""Run one of hsx's playbooks through ansible-runner for `hsx recover|takeover|provision|rollout-patch`.

The playbooks come from the checkout hsx runs from, else from the installed collection hsx.recovery by
FQCN (extraction/fleet/collection.py decides, for these commands and `hsx fleet-status`; neither: exit 2
naming where it looked). Reports default to the checkout's reports/, installed to
$XDG_STATE_HOME/hsx/reports (~/.local/state/hsx/reports).

Artifacts (events, stdout) go to `<reports>/.runner/artifacts/<ident>` (0700), idents
`<UTC stamp>-<kind>-...`; one retention rule, per kind (`prune_artifacts`): the newest KEEP_ARTIFACTS
runs of each playbook are kept (fleet-status keeps its own 5), and a run never removes another
kind's (ansible-runner's own rotation, which counts every kind together, is off). Nothing secret is kept there: env files are never written, the environment
that ansible-runner records in `command` (0600) is dropped and extra-vars values are masked there,
also when the run raises (scrubbed in a `finally`), and a run killed before it could scrub is scrubbed
by the next one; no_log results arrive censored from Ansible itself.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import stat
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from extraction.fleet.collection import OperatorError, Source, default_reports, is_checkout, locate
from extraction.fleet.events import FleetProgress, make_display
from hsx.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_USAGE

REPO = Path(__file__).resolve().parents[2]  # the checkout, when hsx runs from one (collection.is_checkout)
REPORTS = default_reports(REPO)  # REPO/reports, or installed: $XDG_STATE_HOME/hsx/reports
LAB_INVENTORY = REPO / "inventory" / "lab"  # ansible.cfg's default: the test lab's, never a fallback of hsx
KEEP_ARTIFACTS = 10
EXTRA_VARS_FLAGS = ("-e", "--extra-vars")


def add_playbook_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-i",
        "--inventory",
        action="append",
        metavar="INVENTORY",
        help="inventory file, directory or script (repeatable; default: ANSIBLE_INVENTORY; one of them is needed)",
    )
    p.add_argument("-l", "--limit", metavar="HOSTS", help="only these hosts (Ansible pattern)")
    p.add_argument("-C", "--check", action="store_true", help="change nothing; report what would change")
    p.add_argument("-D", "--diff", action="store_true", help="show the differences of changed files")
    p.add_argument(
        "-e",
        "--extra-vars",
        action="append",
        default=[],
        metavar="VARS",
        help="extra variables as key=value, JSON or @file (repeatable)",
    )
    p.add_argument("-t", "--tags", metavar="TAGS", help="only tasks tagged with these (comma separated)")
    p.add_argument("--skip-tags", metavar="TAGS", help="skip tasks tagged with these")
    p.add_argument(
        "--report-dir",
        type=Path,
        metavar="DIR",
        help=f"where reports (and runner artifacts under .runner/) go (default: {REPORTS}; reports/ in the checkout "
        "hsx runs from, installed $XDG_STATE_HOME/hsx/reports, else ~/.local/state/hsx/reports)",
    )


def chosen_inventory(given: list[str] | None, command: str, err: TextIO | None = None) -> list[str]:
    """The inventory an operator's command acts on, said on `err` (stderr): `-i` as given (paths made
    absolute), else ANSIBLE_INVENTORY (comma-separated). Neither: OperatorError - ansible.cfg's default
    is the lab's (inventory/lab), which hsx uses only when it is named."""
    if given:
        chosen, source = [absolute(i) for i in given], "-i"
    else:
        chosen = [absolute(i.strip()) for i in os.environ.get("ANSIBLE_INVENTORY", "").split(",") if i.strip()]
        source = "ANSIBLE_INVENTORY"
    if not chosen and not is_checkout(REPO):
        raise OperatorError("no inventory given: name the one to act on with -i INVENTORY (or set ANSIBLE_INVENTORY). "
                            "Nothing was run")
    if not chosen:
        raise OperatorError(
            "no inventory given: name the one to act on with -i INVENTORY (or set ANSIBLE_INVENTORY). "
            f"ansible.cfg's default, {LAB_INVENTORY.relative_to(REPO)}, is the test lab's: hsx acts on it only "
            f"when named (-i {LAB_INVENTORY.relative_to(REPO)}). Nothing was run"
        )
    lab = source + (": the lab's" if any(Path(i) == LAB_INVENTORY for i in chosen) else "")
    print(f"hsx {command}: inventory: {', '.join(chosen)} ({lab})", file=err or sys.stderr)
    return chosen


def playbook_source(playbook: str | None = None) -> Source:
    """Where the playbooks (and modules) come from: the checkout REPO, else the installed hsx.recovery
    (collection.locate; OperatorError when neither has `playbook`)."""
    return locate(REPO, playbook)


def runner_env(where: Source | None = None) -> dict[str, str]:
    """What ansible-playbook needs to find our config, content and the `hsx` next to this Python
    (`where`: playbook_source() when not given)."""
    return (where or playbook_source()).env()


def scrub_artifacts(artifact_dir: str | os.PathLike) -> None:
    """Drop the environment ansible-runner records in `command` and mask the values of extra vars."""
    path = Path(artifact_dir) / "command"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    argv = list(data.get("command") or [])
    for i, arg in enumerate(argv[:-1]):
        if arg in EXTRA_VARS_FLAGS:
            argv[i + 1] = "<hidden>"
    path.write_text(json.dumps({"command": argv, "cwd": data.get("cwd")}), encoding="utf-8")


def prune_artifacts(pdd: Path, kind: str, keep: int) -> list[Path]:
    """The one retention rule: of the runs of `kind` under `pdd/artifacts` (directories named
    `<YYYYmmddTHHMMSSZ>-<kind>-...`), keep the newest `keep` and remove the rest; returns what it
    removed. Other kinds, other names and links are never touched (a link is not a run of ours)."""
    pattern = re.compile(r"\d{8}T\d{6}Z-" + re.escape(kind) + r"-.*", re.DOTALL)
    runs = []
    for entry in (pdd / "artifacts").glob("*"):
        try:
            is_dir = stat.S_ISDIR(entry.lstat().st_mode)
        except OSError:
            continue
        if is_dir and pattern.fullmatch(entry.name):
            runs.append(entry)
    runs.sort(key=lambda p: p.name)  # the stamp leads the name: oldest first
    doomed = runs[: max(len(runs) - keep, 0)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def scrub_all_artifacts(pdd: Path) -> None:
    """scrub_artifacts for every run under `pdd` (one killed before it could scrub its own)."""
    for artifact_dir in sorted((pdd / "artifacts").glob("*/")):
        scrub_artifacts(artifact_dir)


def absolute(path_or_pattern: str) -> str:
    """Paths the user gave relative to where they are (ansible-playbook runs in the repository)."""
    if path_or_pattern.startswith("@"):
        return "@" + os.path.abspath(path_or_pattern[1:])
    return os.path.abspath(path_or_pattern) if os.path.exists(path_or_pattern) else path_or_pattern


def cmdline_for(args: argparse.Namespace) -> str:
    """Flags ansible-runner has no keyword for, as the one command-line string it takes."""
    argv: list[str] = []
    for ev in args.extra_vars or []:
        argv += ["-e", absolute(ev) if ev.startswith("@") else ev]
    if args.check:
        argv.append("--check")
    if args.diff:
        argv.append("--diff")
    if args.skip_tags:
        argv += ["--skip-tags", args.skip_tags]
    return shlex.join(argv)


def newest_summary(report_dir: Path, since: float) -> Path | None:
    """The newest <report_dir>/<ts>/summary.md written after `since` (when events did not name one)."""
    found = [p for p in report_dir.glob("*/summary.md") if p.stat().st_mtime >= since - 1]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def private_data_dir(report_dir: Path) -> Path:
    pdd = report_dir / ".runner"
    pdd.mkdir(parents=True, exist_ok=True, mode=0o700)
    return pdd


def run_playbook(args: argparse.Namespace, playbook: str, title: str, out: TextIO = sys.stdout) -> int:
    """Run `playbooks/<playbook>` (the checkout's, else the installed collection's by FQCN), show progress,
    print its report; exit 0 ok, 1 a host failed, 2 usage (or no playbook: where it was looked for)."""
    import ansible_runner

    try:
        where = playbook_source(playbook)
    except OperatorError as e:
        print(f"hsx {title}: {e}", file=sys.stderr)
        return EXIT_USAGE
    if where.checkout is None:
        print(f"hsx {title}: playbook {where.playbook(playbook)}: {where.describe()}", file=sys.stderr)
    report_dir = (args.report_dir or REPORTS).resolve()
    extra = list(args.extra_vars or [])
    # Installed, always: the playbooks' own default (playbook_dir/../reports) lies inside the collection.
    if args.report_dir or where.checkout is None:
        extra.append(json.dumps({"hsx_report_dir": str(report_dir)}))
    args.extra_vars = extra
    progress = FleetProgress()
    display = make_display(progress, out, title=f"hsx {title}")
    started = time.time()
    ident = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started)) + f"-{Path(playbook).stem}-{os.getpid()}"
    pdd = private_data_dir(report_dir)
    scrub_all_artifacts(pdd)
    try:
        runner = ansible_runner.run(
            private_data_dir=str(pdd),
            project_dir=str(where.project_dir()),
            playbook=where.playbook(playbook),
            inventory=[absolute(i) for i in args.inventory] if args.inventory else None,
            limit=args.limit,
            tags=args.tags,
            cmdline=cmdline_for(args) or None,
            envvars=where.env(),
            ident=ident,
            rotate_artifacts=0,  # ours, per kind (prune_artifacts below)
            suppress_env_files=True,
            quiet=True,
            event_handler=display,
        )
    finally:
        # ansible-runner writes os.environ into artifacts/<ident>/command before anything else: never
        # leave it there, whatever happened (an exception in our event handler, Ctrl-C).
        scrub_artifacts(pdd / "artifacts" / ident)
        prune_artifacts(pdd, Path(playbook).stem, KEEP_ARTIFACTS)
        display.close()
    return finish(runner, progress, report_dir, started, out)


def finish(runner: Any, progress: FleetProgress, report_dir: Path, started: float, out: TextIO) -> int:
    """The recap, the playbook's report and the exit code."""
    if not progress.hosts:
        tail = runner.stdout.read()[-4000:] if runner.stdout else ""
        print(
            f"hsx: ansible-playbook ended (rc={runner.rc}, {runner.status}) before any host ran:\n{tail}",
            file=sys.stderr,
        )
        return EXIT_USAGE if runner.rc in (4, 5) or runner.status != "failed" else EXIT_FAILED
    print("", file=out)
    print("\n".join(progress.recap_lines()), file=out)
    summary = Path(progress.report_dir) / "summary.md" if progress.report_dir else None
    if summary is None or not summary.is_file():
        summary = newest_summary(report_dir, started)
    if summary is not None and summary.is_file():
        print(f"\n{summary.read_text(encoding='utf-8')}", end="", file=out)
        print(f"\nReport: {summary.parent}", file=out)
    print(f"Runner artifacts: {runner.config.artifact_dir}", file=out)
    if progress.any_bad() or runner.rc != 0:
        return EXIT_FAILED
    return EXIT_OK
