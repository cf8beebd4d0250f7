"""The package's shape: no import cycle among nanoqwen's modules, counting the imports made inside functions
(`lint-imports`, run by ./test.sh, holds the layers themselves to pyproject.toml's contract), and no import of
a nanoqwen module inside a function except where it loads an optional heavy dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp

PACKAGE = Path(__file__).resolve().parents[1] / "nanoqwen"
# (importing module, imported module): imports made where they are used, because the imported module needs an
# optional dependency at import time (Triton, and TRITON_INTERPRET read when it is imported)
LAZY_IMPORTS = {("nanoqwen.attention.backends.paged", "nanoqwen.attention.backends.triton_paged")}


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycle():
    graph = grimp.build_graph("nanoqwen")
    assert len(graph.modules) > 80  # (the whole package was read)
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for a, b in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")]:
        graph.add_import(importer=a, imported=b)
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]


def function_level_imports(path: Path, module: str) -> set[tuple[str, str]]:
    """(module, imported nanoqwen module) for each import statement inside a function of `path`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith("nanoqwen"):
                    found.add((module, inner.module))
                elif isinstance(inner, ast.Import):
                    found |= {(module, a.name) for a in inner.names if a.name.startswith("nanoqwen")}
    return found


def test_nanoqwen_modules_are_imported_at_the_top():
    found = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found |= function_level_imports(path, module)
    assert found == LAZY_IMPORTS
