"""The SGLang releases' own files, read by AST (what the fidelity tests, test_sglang_fidelity*.py, check
against): `release_source(version)` keeps a release's modules, parsed; small AST helpers.

Why by AST: importing sglang.srt.server_args or forward_batch_info needs the release's heavy
dependencies (torch, msgspec, triton, ...), which neither CI nor a control node has. The release
files come from tests/sglang_wheels.py (`pip download --no-deps`, cached; an unreachable registry
FAILS these tests) and are parsed with `ast`.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sglang_wheels  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


class Unresolved(Exception):
    """A name or value of the release that the AST reading cannot follow."""


# ---------------------------------------------------------------------------- release sources


class Source:
    """The kept files of one release (tests/sglang_wheels.py KEEP_SRC), parsed on demand, with the
    module-level names resolved through `from sglang... import` into the other kept files."""

    def __init__(self, root: Path):
        self.root = root
        self._trees: dict[str, ast.Module | None] = {}

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._trees:
            base = self.root / dotted.replace(".", "/")
            path = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()), None)
            self._trees[dotted] = ast.parse(path.read_text(), str(path)) if path else None
        return self._trees[dotted]

    def lookup(self, dotted: str, name: str, depth: int = 0) -> tuple[str, ast.AST]:
        """(module, node) of what `name` is bound to at the top level of module `dotted`: a class or
        function definition, an assigned value, or (followed) what an import brings in."""
        tree = self.module(dotted)
        if tree is None or depth > 8:
            raise Unresolved(f"{name}: module {dotted} is not kept")
        found: tuple[str, Any] | None = None
        for node in tree.body:  # the last binding wins, as at run time
            if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == name:
                found = (dotted, node)
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                found = (dotted, node.value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if node.target.id == name and node.value is not None:
                    found = (dotted, node.value)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        found = ("import", (node.module, alias.name))
        if found is None:
            raise Unresolved(f"{name}: not defined at the top of {dotted}")
        if found[0] == "import":
            module, original = found[1]
            if not module.startswith("sglang."):
                raise Unresolved(f"{name}: imported from {module}")
            return self.lookup(module, original, depth + 1)
        return found

    def literal(self, dotted: str, node: ast.AST, scope: dict[str, ast.AST] | None = None) -> Any:
        """The value of a constant expression: literals, names of module constants, Class.ATTR,
        + of sequences, list()/tuple()/sorted() of one; Unresolved for anything else."""
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.List | ast.Tuple | ast.Set):
            return [self.literal(dotted, e, scope) for e in node.elts]
        if isinstance(node, ast.Name):
            if scope and node.id in scope:
                return self.literal(dotted, scope[node.id], scope)
            module, value = self.lookup(dotted, node.id)
            return self.literal(module, value)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module, cls = self.lookup(dotted, node.value.id)
            if isinstance(cls, ast.ClassDef):
                attrs = class_assigns(cls)
                if node.attr in attrs:
                    return self.literal(module, attrs[node.attr], attrs)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return list(self.literal(dotted, node.left, scope)) + list(
                self.literal(dotted, node.right, scope)
            )
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("list", "tuple", "sorted", "set")
            and len(node.args) == 1
            and not node.keywords
        ):
            return (
                sorted(self.literal(dotted, node.args[0], scope))
                if node.func.id == "sorted"
                else list(self.literal(dotted, node.args[0], scope))
            )
        raise Unresolved(f"{ast.unparse(node)} (in {dotted})")


@functools.cache
def release_source(version: str) -> Source:
    """The kept files of `version` (fetched once, parsed once per session)."""
    return Source(sglang_wheels.release_src(version))


def class_assigns(cls: ast.ClassDef) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = stmt.value
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            out[stmt.target.id] = stmt.value
    return out


def find_class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"class {name} not found")


def find_function(body: list[ast.stmt], name: str) -> ast.FunctionDef:
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"function {name} not found")


def dotted_name(node: ast.AST) -> str:
    return ast.unparse(node) if isinstance(node, ast.Name | ast.Attribute) else ""
