"""`hsx patch status|apply|revert --sglang PATH [--target NAME | --model DIR]`: the SGLang dump
patch, for a node without Ansible. The target (the model file patched) is named, or read from the
model's config.json (`architectures`); without either, deepseek_v2 (the patch's first target)."""

from __future__ import annotations

import argparse
import json
import sys

from extraction.sglang import install
from hsx import patching, sglang_patch
from hsx.exitcodes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from hsx.sglang_versions import TargetError, resolve_target, target_file


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "patch",
        help="inspect, apply or revert the SGLang hidden-state dump patch",
        description=(
            "PATH is the sglang package directory, a source checkout, a venv/prefix, or a python "
            "executable whose environment has sglang."
        ),
    )
    parser.add_argument("action", choices=("status", "apply", "revert"))
    parser.add_argument("--sglang", required=True, metavar="PATH", help="where SGLang is installed")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--target",
        choices=sorted(sglang_patch.TARGETS),
        help=f"the model file to patch (default {sglang_patch.DEFAULT_TARGET}): "
        + "; ".join(
            f"{name}: {target_file(name)['file']}, {', '.join(spec['architectures'])}"
            for name, spec in sorted(sglang_patch.TARGETS.items())
        ),
    )
    which.add_argument(
        "--model",
        metavar="DIR",
        help="the model the server runs: its config.json's architectures choose the target",
    )
    parser.add_argument("--check", action="store_true", help="say what would change, change nothing")
    parser.add_argument("--diff", action="store_true", help="print the unified diff of the patched file")
    parser.add_argument(
        "--force",
        action="store_true",
        help="patch a version outside the supported list / at the first of several anchor matches",
    )
    parser.add_argument("--no-backup", action="store_true", help="do not keep a copy of the file changed")
    parser.add_argument("--keep-hook", action="store_true", help="revert: leave the hook module in place")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)


def _emit(args: argparse.Namespace, data: dict, lines: list[str]) -> None:
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print("\n".join(lines))


def run(args: argparse.Namespace) -> int:
    try:
        pkg = install.find_package(args.sglang)
        target = resolve_target(args.target, args.model)
    except (install.InstallError, TargetError) as exc:
        print(f"hsx patch: {exc}", file=sys.stderr)
        return EXIT_USAGE
    file = target_file(target)["file"]
    try:
        if args.action == "status":
            st = install.status(pkg, target)
            data = {
                "package": st.package,
                "target": target,
                "file": file,
                "version": st.version,
                "status": st.patch.status,
                "summary": st.summary,
                "found_version": st.patch.found_version,
                "wanted_version": install.dump_patch(target).version,
                "hook": st.hook,
                "unsupported": st.unsupported,
                "ok": st.ok,
            }
            _emit(
                args,
                data,
                [f"{st.package}: {file} (target {target}): SGLang {st.version or '?'}: {st.summary}"],
            )
            return EXIT_OK if st.ok else EXIT_FAILED
        keep_for: list[str] = []
        if args.action == "apply":
            result, hook_changed = install.apply(
                pkg, check_mode=args.check, force=args.force, backup=not args.no_backup, target=target
            )
        else:
            result, hook_changed, keep_for = install.revert(
                pkg,
                check_mode=args.check,
                remove_hook=not args.keep_hook,
                backup=not args.no_backup,
                target=target,
            )
    except (patching.PatchError, OSError) as exc:
        print(f"hsx patch: {exc}", file=sys.stderr)
        return EXIT_FAILED
    changed = result.changed or hook_changed
    verb = "would change" if args.check else "changed"
    lines = [
        f"{pkg}: {file} (target {target}): {result.before} -> {result.after}: {verb if changed else 'no change'}"
        + (f" (hook module {'deployed' if args.action == 'apply' else 'removed'})" if hook_changed else "")
    ]
    if keep_for:
        lines.append(f"hook module kept: {', '.join(keep_for)} still call it")
    if result.backup:
        lines.append(f"backup: {result.backup}")
    if result.message:
        lines.append(f"warning: {result.message}")
    if args.diff and result.diff:
        lines.append(result.diff.rstrip("\n"))
    data = {
        "package": str(pkg),
        "target": target,
        "file": file,
        "changed": changed,
        "check_mode": args.check,
        "before": result.before,
        "after": result.after,
        "patch_changed": result.changed,
        "hook_changed": hook_changed,
        "hook_kept_for": keep_for,
        "backup": result.backup,
        "original_verified": result.original_verified,
        "diff": result.diff if args.diff else None,
    }
    _emit(args, data, lines)
    return EXIT_OK
