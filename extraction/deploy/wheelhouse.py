"""The control node's wheelhouse: this package's wheel plus every runtime dependency, pinned.

Real nodes are often air-gapped and the lab hosts have no network at all, so hosts install only
from a directory of wheels the control node built (`pip install --no-index`). The wheelhouse is
rebuilt only when its inputs change (the package's files or the constraints), and its
`wheelhouse.json` carries one digest of everything in it: hosts compare that digest with the one
recorded in their venv to decide whether anything must be installed (idempotent deploys).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

MANIFEST = "wheelhouse.json"
DIST_NAME = "hsx-extraction"
# Hosts receive the wheels as one uncompressed tar (wheels are compressed already): one transfer
# instead of one SSH round trip per wheel (40 wheels took ~160 s per host; the tar ~5 s).
ARCHIVE_PREFIX = "wheels-"


class WheelhouseError(RuntimeError):
    """Building the wheelhouse failed; the message says which step and why."""


def source_root() -> Path:
    """The checkout this package runs from (an editable install on the control node)."""
    root = Path(__file__).resolve().parents[2]  # extraction/deploy/wheelhouse.py -> the checkout
    if not (root / "pyproject.toml").is_file():
        raise WheelhouseError(
            f"{root} is not a source checkout (no pyproject.toml): build the wheelhouse "
            "from the repository's venv"
        )
    return root


def wheel_content_digest(wheel: Path) -> str:
    """Digest of a wheel's files (names + contents), independent of zip timestamps."""
    h = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf:
        for name in sorted(zf.namelist()):
            h.update(name.encode() + b"\0")
            h.update(hashlib.sha256(zf.read(name)).digest())
    return h.hexdigest()


def _pip(*args: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise WheelhouseError(f"pip {' '.join(args[:2])} failed:\n{proc.stderr.strip()[-3000:]}")


def build(dest: Path, source: Path | None = None, constraints: Path | None = None) -> dict:
    """Build or refresh `dest`; returns the manifest with `changed` saying whether anything moved.

    Two playbooks started at once (two operators, two test lanes) share one wheelhouse: the
    second waits on a lock and then finds it built.
    """
    source = source or source_root()
    constraints = constraints or source / "constraints.txt"
    if not constraints.is_file():
        raise WheelhouseError(f"constraints file {constraints} not found")
    dest.mkdir(parents=True, exist_ok=True)
    with open(dest / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_locked(dest, source, constraints)


def _build_locked(dest: Path, source: Path, constraints: Path) -> dict:
    old = read_manifest(dest)
    inputs = source_digest(source, constraints)
    if old and old.get("source_digest") == inputs and _complete(dest, old):
        return {**old, "changed": False}  # nothing to build: every playbook run asks, most change nothing
    with tempfile.TemporaryDirectory(prefix="hsx-wheel-") as tmp:
        _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp, str(source))
        built = next(Path(tmp).glob("*.whl"), None)
        if built is None:
            raise WheelhouseError(f"pip wheel produced no wheel for {source}")
        digest = wheel_content_digest(built)
        constraints_digest = hashlib.sha256(constraints.read_bytes()).hexdigest()
        if (
            old
            and old.get("package_digest") == digest
            and old.get("constraints_digest") == constraints_digest
            and _complete(dest, old)
        ):
            _write_manifest(dest, {**old, "source_digest": inputs})
            return {**old, "source_digest": inputs, "changed": False}
        # Resolve into a staging directory (reusing wheels already here), then make `dest` exactly
        # that set: a stale wheel left beside a pinned one could be picked by a host's resolver.
        staging = Path(tmp) / "staging"
        staging.mkdir()
        shutil.copy2(built, staging / built.name)
        _pip(
            "download",
            "-q",
            "-c",
            str(constraints),
            "--find-links",
            str(dest),
            "-d",
            str(staging),
            str(staging / built.name),
        )
        not_wheels = sorted(p.name for p in staging.iterdir() if p.suffix != ".whl")
        if not_wheels:
            raise WheelhouseError(
                f"pip downloaded source distributions that hosts would have to build: {not_wheels}"
            )
        wheels = sorted(p.name for p in staging.glob("*.whl"))
        for existing in dest.glob("*.whl"):
            if existing.name not in wheels or existing.name == built.name:
                existing.unlink()
        for name in wheels:
            if not (dest / name).exists():
                shutil.move(str(staging / name), dest / name)
    manifest = {
        "package": DIST_NAME,
        "package_wheel": built.name,
        "version": built.name.split("-")[1],
        "package_digest": digest,
        "constraints_digest": constraints_digest,
        "wheels": wheels,
    }
    manifest["digest"] = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    manifest["archive"] = write_archive(dest, wheels, manifest["digest"])
    manifest["source_digest"] = inputs
    _write_manifest(dest, manifest)
    return {**manifest, "changed": True}


def source_digest(source: Path, constraints: Path) -> str:
    """Digest of what the wheelhouse is built from: the package's files, pyproject and the pins.

    Cheap (no build) so that a playbook run with nothing changed costs no `pip wheel`; the
    package's wheel digest still decides, after a rebuild, whether anything really differs.
    """
    h = hashlib.sha256()
    files = [source / "pyproject.toml", constraints]
    for package in (source / "extraction", source / "module_utils" / "hsx"):  # the wheel's two packages
        files += sorted(p for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in files:
        h.update(str(path.relative_to(source) if path.is_relative_to(source) else path).encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def _complete(dest: Path, manifest: dict) -> bool:
    """Every file the manifest names is in `dest`."""
    names = [manifest.get("package_wheel", "-"), *manifest.get("wheels", []), manifest.get("archive", "-")]
    return all((dest / name).is_file() for name in names)


def _write_manifest(dest: Path, manifest: dict) -> None:
    tmp_manifest = dest / f".{MANIFEST}.tmp"
    tmp_manifest.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp_manifest, dest / MANIFEST)


def write_archive(dest: Path, wheels: list[str], digest: str) -> str:
    """Pack `wheels` into `wheels-<digest>.tar` (deterministic, atomic); drop older archives."""
    name = f"{ARCHIVE_PREFIX}{digest[:16]}.tar"
    tmp = dest / f".{name}.tmp"
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for wheel in sorted(wheels):
            info = tar.gettarinfo(dest / wheel, arcname=wheel)
            info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
            with open(dest / wheel, "rb") as fh:
                tar.addfile(info, fh)
    os.replace(tmp, dest / name)
    for old in dest.glob(f"{ARCHIVE_PREFIX}*.tar"):
        if old.name != name:
            old.unlink()
    return name


def read_manifest(dest: Path) -> dict | None:
    try:
        return json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
