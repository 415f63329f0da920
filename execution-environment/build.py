#!/usr/bin/env python3
"""Build the execution environment's inputs from this checkout and its build context (no image).

    .venv/bin/python execution-environment/build.py [--out .cache/ee]

1. the collection's tarball (tools/collection/build.py), copied as OUT/artifacts/hsx-recovery.tar.gz
   (the name execution-environment/requirements.yml installs it by; ansible-galaxy reads the
   collection's name and version from the tarball itself);
2. the control node's wheel, hsx-control (pyproject.toml [tool.hsx.control]: the same packages and
   `hsx` entry point as hsx-extraction, its own name and dependencies - no torch, no transformers),
   into OUT/artifacts;
3. `ansible-builder create` of execution-environment/execution-environment.yml into OUT/context.

Then `podman build -t hsx-ee OUT/context` (or docker) builds the image. Nothing is taken from an index
by name but ansible-core, ansible-runner (pinned in the definition, as constraints.txt pins them) and
ansible-builder's own build tools: the collection is installed from its file, the wheel with --no-index.

Exit status: 0 built; 2 the definition's pins differ from constraints.txt or an input is missing (the
message says which and what to do); 1 a build step failed (its output is shown).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
DEFINITION = HERE / "execution-environment.yml"
DEFAULT_OUT = ROOT / ".cache" / "ee"
TARBALL = "hsx-recovery.tar.gz"
# What the definition installs by name, each pinned there as constraints.txt pins it.
PINNED = ("ansible_core", "ansible_runner")


class EEError(Exception):
    """An input of the execution environment is missing or disagrees with its source of truth."""


def _collection_build():
    spec = importlib.util.spec_from_file_location("hsx_collection_build", ROOT / "tools" / "collection" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def constraint(name: str) -> str:
    """constraints.txt's pin of `name` (`name==X`); EEError when it has none."""
    want = re.sub(r"[-_.]+", "-", name).lower()
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        pkg, sep, version = line.strip().partition("==")
        if sep and re.sub(r"[-_.]+", "-", pkg).lower() == want:
            return f"{pkg}=={version}"
    raise EEError(f"constraints.txt pins no {name}")


def check_pins(definition: dict) -> None:
    """EEError unless the definition's ansible-core and ansible-runner are constraints.txt's pins."""
    for key in PINNED:
        given = definition["dependencies"][key]["package_pip"]
        want = constraint(given.split("==")[0])
        if given != want:
            raise EEError(f"{DEFINITION.relative_to(ROOT)}: dependencies.{key}.package_pip is {given!r}, "
                          f"constraints.txt pins {want!r}: make them one (edit the definition)")


def _toml(value: object) -> str:
    """A TOML value for a str, a list of them, or a table of them (JSON's syntax is TOML's for these)."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    raise EEError(f"pyproject.toml: a value of type {type(value).__name__} where a string, list or table was expected")


def control_pyproject(pyproject: dict) -> str:
    """The hsx-control distribution's pyproject.toml: [project] as pyproject's, with [tool.hsx.control]'s
    name and dependencies, no extras (the node's); the same build system and package discovery."""
    project, control = dict(pyproject["project"]), pyproject["tool"]["hsx"]["control"]
    project.pop("optional-dependencies", None)
    project["name"], project["dependencies"] = control["name"], control["dependencies"]
    project["description"] = project.get("description", "") + " (control node: the hsx CLI without torch)"
    scripts, urls = project.pop("scripts", {}), project.pop("urls", {})
    lines = ["[build-system]", *(f"{k} = {_toml(v)}" for k, v in pyproject["build-system"].items()), "", "[project]"]
    lines += [f"{k} = {_toml(v)}" for k, v in project.items()]
    for table, content in (("project.scripts", scripts), ("project.urls", urls),
                           ("tool.setuptools.packages.find", pyproject["tool"]["setuptools"]["packages"]["find"])):
        if content:
            lines += ["", f"[{table}]", *(f"{_toml(k)} = {_toml(v)}" for k, v in content.items())]
    return "\n".join(lines) + "\n"


def build_control_wheel(dest: Path) -> Path:
    """The hsx-control wheel of this checkout, built in a copy of its packages; its path in `dest`."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    with tempfile.TemporaryDirectory(prefix="hsx-control-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(ROOT / "extraction", src / "extraction", ignore=ignore)
        shutil.copytree(ROOT / "module_utils" / "hsx", src / "module_utils" / "hsx", ignore=ignore)
        for name in ("LICENSE", *pyproject["project"].get("license-files", [])):
            shutil.copy2(ROOT / name, src / name)
        (src / "pyproject.toml").write_text(control_pyproject(pyproject))
        done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps",
                               "--no-build-isolation", "-w", str(Path(tmp) / "out"), str(src)],
                              capture_output=True, text=True)
        if done.returncode:
            raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)
        wheel, = (Path(tmp) / "out").glob("*.whl")
        for old in dest.glob("hsx_control-*.whl"):
            old.unlink()
        return Path(shutil.copy2(wheel, dest / wheel.name))


def build(out: Path) -> Path:
    """Artifacts and the build context under `out`; returns the context's directory."""
    definition = yaml.safe_load(DEFINITION.read_text())
    check_pins(definition)
    artifacts = out / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    collection = _collection_build()
    coll_out = out / "collection"
    try:
        tarball = collection.build_tarball(collection.build(coll_out), coll_out / "dist")
    except (collection.BuildError, collection.ChangelogError) as exc:
        raise EEError(f"the collection did not build: {exc}") from None
    shutil.copy2(tarball, artifacts / TARBALL)
    build_control_wheel(artifacts)
    # ansible-builder takes the definition's relative paths from the definition's folder: give it a
    # copy beside the artifacts, so that OUT may be anywhere.
    shutil.copy2(DEFINITION, out / DEFINITION.name)
    shutil.copy2(HERE / "requirements.yml", out / "requirements.yml")
    context = out / "context"
    shutil.rmtree(context, ignore_errors=True)
    builder = Path(sys.executable).parent / "ansible-builder"
    done = subprocess.run([str(builder), "create", "-f", str(out / DEFINITION.name), "-c", str(context),
                           "--output-filename", "Containerfile"], capture_output=True, text=True)
    if done.returncode:
        raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)
    return context


def introspect(out: Path) -> dict:
    """What ansible-builder's introspection takes from the built collection (as the image's builder stage
    does, on the collection installed from OUT/artifacts, but without the definition's exclusions):
    {"python": [...], "system": [...]}."""
    bin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory(prefix="hsx-ee-introspect-") as tmp:
        # --force, and away from the checkout: its ansible.cfg's collections path holds an hsx.recovery
        # (a link), which would make the install a no-op.
        subprocess.run([str(bin_dir / "ansible-galaxy"), "collection", "install", "--offline", "--force", "-p", tmp,
                        str(out / "artifacts" / TARBALL)], check=True, capture_output=True, text=True, cwd=tmp)
        if not (Path(tmp) / "ansible_collections" / "hsx" / "recovery" / "MANIFEST.json").is_file():
            raise EEError(f"ansible-galaxy did not install {out / 'artifacts' / TARBALL} into {tmp}")
        # Without the definition's exclusions: what the collection itself declares.
        done = subprocess.run([str(bin_dir / "ansible-builder"), "introspect", "--sanitize", tmp],
                              check=True, capture_output=True, text=True)
    return yaml.safe_load(done.stdout)


def check(out: Path) -> list[str]:
    """What is wrong with the execution environment built under `out` (empty: nothing): the collection
    declares a Python requirement (an index would resolve it) or lacks bindep.txt's system packages; the
    Containerfile does not install the collection from its file and the wheel without an index."""
    problems = []
    found = introspect(out)
    if found.get("python"):
        problems.append(f"the collection declares Python requirements an index would resolve: {found['python']}")
    want = [ln.split("#")[0].strip() for ln in (ROOT / "bindep.txt").read_text().splitlines() if ln.split("#")[0].strip()]
    got = [ln.split("#")[0].strip() for ln in found.get("system") or []]
    if got != want:
        problems.append(f"introspected system packages {got}, bindep.txt has {want}")
    containerfile = (out / "context" / "Containerfile").read_text()
    galaxy = yaml.safe_load((out / "context" / "_build" / "requirements.yml").read_text())
    if galaxy.get("collections") != [{"name": f"/build/hsx/{TARBALL}", "type": "file"}]:
        problems.append(f"requirements.yml installs {galaxy.get('collections')}, not only the tarball's file")
    if "pip install --no-cache-dir --no-index /tmp/hsx/hsx_control-" not in containerfile:
        problems.append("the Containerfile does not install the hsx-control wheel with --no-index")
    if not list((out / "context" / "_build" / "hsx").glob("hsx_control-*.whl")):
        problems.append("the build context has no hsx-control wheel")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="artifacts and context here (default: .cache/ee)")
    parser.add_argument("--check", action="store_true",
                        help="then check it: introspection finds no Python requirement, the artifacts are used (exit 1 if not)")
    args = parser.parse_args(argv)
    try:
        context = build(args.out.resolve())
        problems = check(args.out.resolve()) if args.check else []
    except EEError as exc:
        print(f"execution environment: {exc}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as exc:
        print(f"execution environment: {' '.join(map(str, exc.cmd[:3]))} failed:\n{exc.stdout}{exc.stderr}",
              file=sys.stderr)
        return 1
    for problem in problems:
        print(f"execution environment: {problem}", file=sys.stderr)
    print(context)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
