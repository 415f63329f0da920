"""The control node's distribution, hsx-control (pyproject.toml [tool.hsx.control], built by
execution-environment/build.py): the `hsx` CLI without the node's torch and transformers. Its metadata
names neither, and the control node's commands run where they cannot be imported (every import of
them in those commands is lazy). The wheel's build and the execution environment's `ansible-builder
create` and introspection run in make sanity (`execution-environment/build.py --check`)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("hsx_ee_build", ROOT / "execution-environment" / "build.py")
ee = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ee)

NODE_ONLY = ("torch", "transformers", "tokenizers", "safetensors", "numpy")
# The control node's commands, each run for real as far as it goes without a fleet.
CONTROL_RUNS = """
import sys, importlib.abc
NODE_ONLY = {node_only!r}
class NodeOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in NODE_ONLY:
            raise ImportError(f"{{name}} is the node's (not installed on a control node)")
sys.meta_path.insert(0, NodeOnly())
from extraction.cli import main
codes = {{}}
for argv in {runs!r}:
    try:
        codes[" ".join(argv)] = main(argv)
    except SystemExit as exc:  # --help
        codes[" ".join(argv)] = exc.code
print(codes)
print(sorted(m for m in sys.modules if m.split(".")[0] in NODE_ONLY))
"""


def test_the_control_distribution_names_no_node_package() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    control = tomllib.loads(ee.control_pyproject(pyproject))
    project = control["project"]
    assert project["name"] == "hsx-control" and project["version"] == pyproject["project"]["version"]
    assert project["dependencies"] == pyproject["tool"]["hsx"]["control"]["dependencies"]
    assert not any(d.split("[")[0].split("=")[0].split(">")[0].strip() in NODE_ONLY + ("hsx-extraction",)
                   for d in project["dependencies"]), project["dependencies"]
    assert "optional-dependencies" not in project
    assert project["scripts"] == pyproject["project"]["scripts"]  # the same `hsx`
    assert control["tool"]["setuptools"]["packages"]["find"] == pyproject["tool"]["setuptools"]["packages"]["find"]
    assert control["build-system"] == pyproject["build-system"]


def test_the_control_nodes_commands_run_without_torch_or_transformers(tmp_path: Path) -> None:
    runs = [["--help"], ["selfheal", "status", "--state-dir", str(tmp_path / "state")],
            ["selfheal", "remedy", "--help"], ["recover", "--help"], ["takeover", "--help"],
            ["fleet-status", "--help"], ["wheelhouse", "--help"], ["provision", "--help"], ["report", "--help"]]
    done = subprocess.run([sys.executable, "-c", CONTROL_RUNS.format(node_only=NODE_ONLY, runs=runs)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    codes, imported = done.stdout.strip().splitlines()[-2:]
    assert eval(codes) == {" ".join(argv): 0 for argv in runs}, codes  # noqa: S307 - our own repr
    assert imported == "[]"


def test_the_definition_pins_what_constraints_pin() -> None:
    import yaml

    definition = yaml.safe_load(ee.DEFINITION.read_text())
    ee.check_pins(definition)  # raises on a difference
    definition["dependencies"]["ansible_core"]["package_pip"] = "ansible-core==2.0.0"
    try:
        ee.check_pins(definition)
    except ee.EEError as exc:
        assert "constraints.txt pins 'ansible-core==" in str(exc)
    else:
        raise AssertionError("a pin unlike constraints.txt's was accepted")
