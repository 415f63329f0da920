"""Find an SGLang install, read its version, and put the dump patch + hook in or out of it.

The logic behind `hsx patch`; the Ansible side (library/source_patch.py + the sglang_patch role)
uses the same patch core and patch definition, so a node patched by either reads the same.
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
from hsx.sglang_versions import support_problem

HOOK_SOURCE = Path(__file__).with_name("hook.py")
FORMAT_SOURCE = Path(__file__).with_name(sglang_patch.FORMAT_FILENAME)  # the hook imports it
# What is deployed into the sglang package: {name there: the project's file}; the format first, as
# the hook imports it.
DEPLOYED = {sglang_patch.FORMAT_FILENAME: FORMAT_SOURCE, sglang_patch.HOOK_FILENAME: HOOK_SOURCE}


class InstallError(Exception):
    """The SGLang install cannot be found or read; the message says where we looked."""


def dump_patch() -> patching.Patch:
    return patching.Patch.from_dict(sglang_patch.SGLANG_DUMP_PATCH)


def _is_package(path: Path) -> bool:
    return (path / "__init__.py").is_file() and (path / sglang_patch.TARGET).is_file()


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
        f"{p}: no sglang package with {sglang_patch.TARGET} there, in sglang/, python/sglang/ "
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
        raise InstallError(f"{python}: sglang at {pkg} has no {sglang_patch.TARGET}")
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
    unsupported: str | None  # why the version is not supported
    patch: patching.Inspection
    hook: str  # "current" | "missing" | "different": the worst of the deployed files (DEPLOYED)

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


def status(pkg: Path) -> Status:
    version = read_version(pkg)
    text = patching.read_text(str(pkg / sglang_patch.TARGET))
    hook = deployed_state(pkg)
    return Status(str(pkg), version, support_problem(version), patching.examine(text, dump_patch()), hook)


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
    pkg: Path, check_mode: bool = False, force: bool = False, backup: bool = True
) -> tuple[patching.Result, bool]:
    """Deploy the hook, then patch. Refuses unsupported versions unless forced."""
    problem = support_problem(read_version(pkg))
    if problem and not force:
        raise patching.PatchError(f"{pkg}: {problem}; nothing changed (--force to patch anyway)")
    # Plan the source patch first, so a refusal leaves the hook undeployed too.
    patching.plan(patching.read_text(str(pkg / sglang_patch.TARGET)), dump_patch(), "present", force)
    hook_changed = deploy_files(pkg, check_mode)
    result = patching.apply_file(
        str(pkg / sglang_patch.TARGET),
        dump_patch(),
        "present",
        force=force,
        backup=backup,
        check_mode=check_mode,
    )
    return result, hook_changed


def revert(
    pkg: Path, check_mode: bool = False, remove_hook: bool = True, backup: bool = True
) -> tuple[patching.Result, bool]:
    """Remove the patch (byte-identical original) and, by default, the deployed files (DEPLOYED)."""
    result = patching.apply_file(
        str(pkg / sglang_patch.TARGET), dump_patch(), "absent", backup=backup, check_mode=check_mode
    )
    present = [pkg / name for name in DEPLOYED if (pkg / name).exists()] if remove_hook else []
    if not check_mode:
        for dest in reversed(present):  # the hook before the format it imports
            dest.unlink()
    return result, bool(present)
