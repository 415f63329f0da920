"""The shape of the `extraction` package: no import cycles between its modules, no loose modules.

The import graph is read from the source with `ast` (nothing is imported): every
`import extraction...` and `from extraction... import ...` at any depth of a module (module level,
inside a function, under `if TYPE_CHECKING:`) is an edge, and `from extraction.pkg import name` is
an edge to the module `extraction.pkg.name` when that is a module, else to the package
`extraction.pkg`. Importing a module first imports its parent packages, but those edges are left
out: they are implicit in every import and a package's `__init__` is held to the same rule anyway.

The top of extraction/ holds only `__init__.py`, `cli.py` (the console entry point
`extraction.cli:main`) and packages named for what lives in them.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "extraction"
TOP_LEVEL_MODULES = frozenset({"__init__.py", "cli.py"})


def module_name(path: Path, root: Path = PACKAGE) -> str:
    """`extraction/a/b.py` -> `extraction.a.b`; `extraction/a/__init__.py` -> `extraction.a`."""
    parts = (root.name, *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, known: set[str]) -> str | None:
    """The known module `name` names, or the nearest known package above it; None outside the set."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against `importer`)."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of `root`'s package it imports anywhere in its source."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    known = set(paths)
    graph: dict[str, set[str]] = {}
    for mod, path in paths.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, mod, path.name == "__init__.py")
                targets = [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                found = _resolve(target, known)
                if found and found != mod:
                    edges.add(found)
        graph[mod] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (each one an import circle),
    as its modules in a cycle order starting from the smallest name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the graph is a few dozen modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(_cycle_in(sorted(comp), graph))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One cycle through the component's first module, as a path that returns to it."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:  # breadth-first: the shortest way back to `start`
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return component  # unreachable for a strongly connected component


def test_no_import_cycles_between_extraction_modules():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles in extraction/: " + "; ".join(" -> ".join(c) for c in cycles)


def test_only_init_and_cli_sit_at_the_top_of_extraction():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in TOP_LEVEL_MODULES)
    assert not loose, f"modules directly in extraction/ (put each in the package of its concern): {', '.join(loose)}"


def test_the_graph_sees_function_level_and_type_checking_imports(tmp_path):
    """The reader itself: a cycle made only of a function-level import and a TYPE_CHECKING one,
    and a relative import, are all found (so a green run above means something)."""
    pkg = tmp_path / "extraction"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    from extraction.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import X\n")
    (pkg / "sub" / "c.py").write_text("import extraction.sub.a\nX = 1\n")
    graph = import_graph(pkg)
    assert graph["extraction.sub.a"] == {"extraction.sub.b"}
    assert graph["extraction.sub.b"] == {"extraction.sub.c"}
    assert find_cycles(graph) == [["extraction.sub.a", "extraction.sub.b", "extraction.sub.c", "extraction.sub.a"]]
