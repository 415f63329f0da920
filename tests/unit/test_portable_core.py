"""The portable core module_utils/hsx: what Ansible ships to hosts that have neither torch nor the
extraction package. Every module imports only the standard library and, inside the package, its
siblings by relative import (absolute `hsx.` imports would not resolve as ansible.module_utils.hsx)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "module_utils" / "hsx"
CORE_FILES = sorted(CORE.rglob("*.py"))
STDLIB = sys.stdlib_module_names


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def foreign_imports(path: Path) -> list[str]:
    """Every import in the file (at any depth: functions, TYPE_CHECKING blocks) that is neither
    relative nor of a standard-library module, as `line: module`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level > 0:  # from . / from .. : the package's own modules
                continue
            names = [node.module or ""]
        else:
            continue
        found += [f"{node.lineno}: {name}" for name in names if name.split(".")[0] not in STDLIB]
    return found


def test_the_core_is_one_package_of_real_files():
    assert CORE_FILES, "module_utils/hsx is empty"
    loose = sorted(p.name for p in (ROOT / "module_utils").iterdir() if p.name not in ("hsx", "__pycache__"))
    assert loose == [], "module_utils/ holds the hsx package only"
    links = [_rel(p) for p in (ROOT / "module_utils").rglob("*") if p.is_symlink()]
    assert links == []
    for folder in {p.parent for p in CORE_FILES}:
        assert (folder / "__init__.py").is_file(), f"{_rel(folder)} is not a package"


@pytest.mark.parametrize("path", CORE_FILES, ids=_rel)
def test_core_modules_import_only_the_stdlib_and_each_other(path):
    assert foreign_imports(path) == []


@pytest.mark.parametrize("path", CORE_FILES, ids=_rel)
def test_core_modules_are_not_named_like_stdlib_modules(path):
    # `hsx/pickle.py` would be shadowed by (or shadow) the stdlib's wherever module_utils is a path.
    names = [path.stem] if path.stem != "__init__" else []
    names += [p.name for p in path.relative_to(CORE).parents if p.name]
    assert [n for n in names if n in STDLIB] == []


def test_the_package_init_imports_nothing():
    """Shipping one module ships hsx/__init__.py too: it must not pull in the rest."""
    tree = ast.parse((CORE / "__init__.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def test_the_check_catches_what_it_should(tmp_path):
    """The checks above on made-up files: third-party, absolute self-imports, stdlib names."""
    bad = tmp_path / "zipfile.py"
    bad.write_text(
        "import os\nfrom . import layout\nfrom ..index import read_index\nimport torch\n"
        "def f():\n    from hsx.layout import SHARDS_DIR\n    import extraction.status\n"
    )
    assert foreign_imports(bad) == ["4: torch", "6: hsx.layout", "7: extraction.status"]
    assert bad.stem in STDLIB
