"""Every module's DOCUMENTATION, EXAMPLES and RETURN is YAML (ansible-doc and ansible-test's
validate-modules read them as such; one that does not parse fails `make sanity` much later, and
only in the built collection). Read from library/ as text: no module is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

LIBRARY = Path(__file__).resolve().parents[2] / "library"
MODULES = sorted(LIBRARY.glob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[p.name for p in MODULES])
def test_the_module_docs_parse_as_yaml(path: Path) -> None:
    blocks = {node.targets[0].id: node.value.value for node in ast.parse(path.read_text()).body
              if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
              and node.targets[0].id in ("DOCUMENTATION", "EXAMPLES", "RETURN")}
    assert set(blocks) == {"DOCUMENTATION", "EXAMPLES", "RETURN"}, f"{path.name}: {sorted(blocks)}"
    for name, text in blocks.items():
        try:
            yaml.safe_load(text)
        except yaml.YAMLError as exc:
            pytest.fail(f"{path.name}: {name} is not YAML: {exc}")
