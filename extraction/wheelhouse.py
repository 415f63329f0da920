"""The control node's wheelhouse: this package's wheel plus every runtime dependency, pinned.

Real nodes are often air-gapped and the lab hosts have no network at all, so hosts install only
from a directory of wheels the control node built (`pip install --no-index`). The wheelhouse is
rebuilt only when its inputs change (the package's files or the constraints), and its
`wheelhouse.json` carries one digest of everything in it: hosts compare that digest with the one
recorded in their venv to decide whether anything must be installed (idempotent deploys).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MANIFEST = "wheelhouse.json"
DIST_NAME = "hsx-extraction"


class WheelhouseError(RuntimeError):
    """Building the wheelhouse failed; the message says which step and why."""


def source_root() -> Path:
    """The checkout this package runs from (an editable install on the control node)."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "pyproject.toml").is_file():
        raise WheelhouseError(f"{root} is not a source checkout (no pyproject.toml): build the wheelhouse "
                              "from the repository's venv")
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
    proc = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise WheelhouseError(f"pip {' '.join(args[:2])} failed:\n{proc.stderr.strip()[-3000:]}")


def build(dest: Path, source: Path | None = None, constraints: Path | None = None) -> dict:
    """Build or refresh `dest`; returns the manifest with `changed` saying whether anything moved."""
    source = source or source_root()
    constraints = constraints or source / "constraints.txt"
    if not constraints.is_file():
        raise WheelhouseError(f"constraints file {constraints} not found")
    dest.mkdir(parents=True, exist_ok=True)
    old = read_manifest(dest)
    with tempfile.TemporaryDirectory(prefix="hsx-wheel-") as tmp:
        _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp, str(source))
        built = next(Path(tmp).glob("*.whl"), None)
        if built is None:
            raise WheelhouseError(f"pip wheel produced no wheel for {source}")
        digest = wheel_content_digest(built)
        constraints_digest = hashlib.sha256(constraints.read_bytes()).hexdigest()
        if (old and old.get("package_digest") == digest and old.get("constraints_digest") == constraints_digest
                and (dest / old["package_wheel"]).is_file()
                and all((dest / w).is_file() for w in old.get("wheels", []))):
            return {**old, "changed": False}
        # Resolve into a staging directory (reusing wheels already here), then make `dest` exactly
        # that set: a stale wheel left beside a pinned one could be picked by a host's resolver.
        staging = Path(tmp) / "staging"
        staging.mkdir()
        shutil.copy2(built, staging / built.name)
        _pip("download", "-q", "-c", str(constraints), "--find-links", str(dest), "-d", str(staging),
             str(staging / built.name))
        not_wheels = sorted(p.name for p in staging.iterdir() if p.suffix != ".whl")
        if not_wheels:
            raise WheelhouseError(f"pip downloaded source distributions that hosts would have to build: {not_wheels}")
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
    tmp_manifest = dest / f".{MANIFEST}.tmp"
    tmp_manifest.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp_manifest, dest / MANIFEST)
    return {**manifest, "changed": True}


def read_manifest(dest: Path) -> dict | None:
    try:
        return json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
