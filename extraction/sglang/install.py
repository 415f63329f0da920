"""Find an SGLang install, read its version, and put the dump patch + hook in or out of it.

The logic behind `hsx patch`; the Ansible side (library/source_patch.py + the sglang_patch role)
uses the same patch core and patch definitions, so a node patched by either reads the same. A
target (hsx.sglang_patch.TARGETS: deepseek_v2, llama, qwen2, qwen3) names the model file patched;
each file has a patch of its own, so several targets can be patched in one install, and the hook
files (DEPLOYED) stay while any file still holds a patch.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hsx import patching, sglang_patch
from hsx.sglang_versions import support_problem, target_file, target_problem

DEFAULT_TARGET = sglang_patch.DEFAULT_TARGET
MODELS_DIR = "srt/models"  # what makes a directory an sglang package here, beside __init__.py

HOOK_SOURCE = Path(__file__).with_name("hook.py")
FORMAT_SOURCE = Path(__file__).with_name(sglang_patch.FORMAT_FILENAME)  # the hook imports it
# What is deployed into the sglang package: {name there: the project's file}; the format first, as
# the hook imports it.
DEPLOYED = {sglang_patch.FORMAT_FILENAME: FORMAT_SOURCE, sglang_patch.HOOK_FILENAME: HOOK_SOURCE}


class InstallError(Exception):
    """The SGLang install cannot be found or read; the message says where we looked."""


def dump_patch(target: str = DEFAULT_TARGET) -> patching.Patch:
    """The patch of the target's file (TargetError for an unknown target)."""
    return patching.Patch.from_dict(sglang_patch.NAMED_PATCHES[target_file(target)["patch"]])


def target_path(pkg: Path, target: str = DEFAULT_TARGET) -> Path:
    """The file the target's patch goes into, in the sglang package `pkg`."""
    return pkg / target_file(target)["file"]


def _is_package(path: Path) -> bool:
    return (path / "__init__.py").is_file() and (path / MODELS_DIR).is_dir()


def find_package(path: str | os.PathLike) -> Path:
    """PATH may be the sglang package dir, a source checkout, a venv/prefix, or a python executable."""
    p = Path(path).expanduser()
    if p.is_file() and os.access(p, os.X_OK):
        return _ask_python(p)
    if not p.is_dir():
        raise InstallError(f"{p}: no such directory or python executable")
    candidates = [p, p / "sglang", p / "python" / "sglang"]
    candidates += [
        Path(c) for c in sorted(glob.glob(str(p / "lib" / "python3*" / "site-packages" / "sglang")))
    ]
    candidates += [
        Path(c) for c in sorted(glob.glob(str(p / "lib" / "python3*" / "dist-packages" / "sglang")))
    ]
    for c in candidates:
        if _is_package(c):
            return c.resolve()
    raise InstallError(
        f"{p}: no sglang package (with {MODELS_DIR}/) there, in sglang/, python/sglang/ "
        "or lib/python3*/site-packages/sglang/"
    )


def _ask_python(python: Path) -> Path:
    code = (
        "import importlib.util, os; s = importlib.util.find_spec('sglang'); print(os.path.dirname(s.origin))"
    )
    try:
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InstallError(f"{python}: cannot run it: {exc}") from None
    if out.returncode != 0:
        raise InstallError(f"{python}: has no importable sglang: {out.stderr.strip().splitlines()[-1:]}")
    pkg = Path(out.stdout.strip())
    if not _is_package(pkg):
        raise InstallError(f"{python}: sglang at {pkg} has no {MODELS_DIR}/")
    return pkg


_VERSION_ASSIGN = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)


def read_version(pkg: Path) -> str | None:
    """The installed distribution's version, else the one written in the package's version files."""
    for meta in sorted(pkg.parent.glob("sglang-*.dist-info/METADATA")):
        m = re.search(r"^Version:\s*(\S+)", meta.read_text(errors="replace"), re.M)
        if m:
            return m.group(1)
    for name in ("_version.py", "version.py"):
        f = pkg / name
        if f.is_file():
            m = _VERSION_ASSIGN.search(f.read_text(errors="replace"))
            if m:
                return m.group(1)
    return None


def _sha(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


@dataclass
class Status:
    package: str
    version: str | None
    unsupported: str | None  # why the version (or the target in it) is not supported
    patch: patching.Inspection
    hook: str  # "current" | "missing" | "different": the worst of the deployed files (DEPLOYED)
    target: str = DEFAULT_TARGET
    file: str = sglang_patch.TARGET  # the target's file, relative to the package

    @property
    def summary(self) -> str:
        """unpatched / patched (version) / outdated / unsupported (why) / damaged (why)."""
        if self.unsupported:
            return f"unsupported ({self.unsupported})"
        st = self.patch.status
        if st == patching.PATCHED:
            text = f"patched (v{self.patch.found_version})"
            return text if self.hook == "current" else f"{text}, but the hook files are {self.hook}"
        if st == patching.OUTDATED:
            return f"outdated ({self.patch.reason})"
        if st in (patching.UNSUPPORTED, patching.DAMAGED):
            return f"{st} ({self.patch.reason})"
        return "unpatched"

    @property
    def ok(self) -> bool:
        return not self.unsupported and self.patch.status == patching.PATCHED and self.hook == "current"


def _problem(pkg: Path, version: str | None, target: str) -> str | None:
    """Why `target` cannot be patched in this install: the release, the target in it, its file."""
    problem = support_problem(version) or target_problem(target, version)
    if problem is None and not target_path(pkg, target).is_file():
        problem = f"this SGLang has no {target_file(target)['file']} (target {target})"
    return problem


def status(pkg: Path, target: str = DEFAULT_TARGET) -> Status:
    version = read_version(pkg)
    path = target_path(pkg, target)
    unsupported = _problem(pkg, version, target)
    text = patching.read_text(str(path)) if path.is_file() else ""
    hook = deployed_state(pkg)
    ins = patching.examine(text, dump_patch(target))
    return Status(str(pkg), version, unsupported, ins, hook, target, target_file(target)["file"])


def patched_files(pkg: Path, skip: str | None = None) -> list[str]:
    """The files of sglang_patch.PATCH_FILES in `pkg` that hold blocks of their patch (any version),
    but `skip` (a file's name in PATCH_FILES): what still imports the hook."""
    held = []
    for name, info in sglang_patch.PATCH_FILES.items():
        path = pkg / info["file"]
        if name == skip or not path.is_file():
            continue
        patch = patching.Patch.from_dict(sglang_patch.NAMED_PATCHES[info["patch"]])
        ins = patching.examine(patching.read_text(str(path)), patch)
        if ins.found or ins.status == patching.DAMAGED:
            held.append(info["file"])
    return held


def deployed_state(pkg: Path) -> str:
    """ "current" when every file of DEPLOYED is in `pkg` as the project has it; else "missing" /
    "different" naming the files that are not (the hook module and the dump format it imports)."""
    missing = [name for name in DEPLOYED if not (pkg / name).is_file()]
    different = [
        name for name, src in DEPLOYED.items() if name not in missing and _sha(pkg / name) != _sha(src)
    ]
    if missing:
        return f"missing ({', '.join(missing)})"
    if different:
        return f"different ({', '.join(different)})"
    return "current"


def deploy_files(pkg: Path, check_mode: bool = False) -> bool:
    """Copy every file of DEPLOYED that differs into `pkg` (temp name, then rename: a server
    starting meanwhile imports the old file or the new, never half of one); whether any differed."""
    changed = False
    for name, src in DEPLOYED.items():
        dest = pkg / name
        if _sha(dest) == _sha(src):
            continue
        changed = True
        if not check_mode:
            tmp = dest.with_name(f".{dest.name}.tmp")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dest)
    return changed


def apply(
    pkg: Path,
    check_mode: bool = False,
    force: bool = False,
    backup: bool = True,
    target: str = DEFAULT_TARGET,
) -> tuple[patching.Result, bool]:
    """Deploy the hook, then patch the target's file. Refuses a release outside the supported list
    unless forced, and always a target its release refuses or whose file it lacks (by name)."""
    version = read_version(pkg)
    refused = target_problem(target, version)
    if refused is None and not target_path(pkg, target).is_file():
        refused = f"this SGLang has no {target_file(target)['file']} (target {target})"
    if refused:
        raise patching.PatchError(f"{pkg}: {refused}; nothing changed")
    problem = support_problem(version)
    if problem and not force:
        raise patching.PatchError(f"{pkg}: {problem}; nothing changed (--force to patch anyway)")
    path = str(target_path(pkg, target))
    # Plan the source patch first, so a refusal leaves the hook undeployed too.
    patching.plan(patching.read_text(path), dump_patch(target), "present", force)
    hook_changed = deploy_files(pkg, check_mode)
    result = patching.apply_file(
        path, dump_patch(target), "present", force=force, backup=backup, check_mode=check_mode
    )
    return result, hook_changed


def revert(
    pkg: Path,
    check_mode: bool = False,
    remove_hook: bool = True,
    backup: bool = True,
    target: str = DEFAULT_TARGET,
) -> tuple[patching.Result, bool, list[str]]:
    """Remove the target's patch (byte-identical original) and, by default, the deployed files
    (DEPLOYED) - unless another file still holds a patch that imports them: those files are
    returned (the hook is kept for them)."""
    result = patching.apply_file(
        str(target_path(pkg, target)), dump_patch(target), "absent", backup=backup, check_mode=check_mode
    )
    keep_for = patched_files(pkg, skip=sglang_patch.TARGETS[target]["file"]) if remove_hook else []
    present = (
        [pkg / name for name in DEPLOYED if (pkg / name).exists()] if remove_hook and not keep_for else []
    )
    if not check_mode:
        for dest in reversed(present):  # the hook before the format it imports
            dest.unlink()
    return result, bool(present), keep_for
