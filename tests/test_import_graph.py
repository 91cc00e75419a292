"""pfl's modules import each other in one direction: the import graph, read from the source with
``ast``, has no circle.

Every import counts — at module level, inside a function, or under ``if TYPE_CHECKING`` — because a
circle dodged by a function-level import is still a circle a reader has to untangle. An edge goes
to the module an import names: ``from .x import y`` is an edge to ``x.y`` when that is a module,
else to ``x``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "pfl"

#: circles allowed for now, each as the sorted set of its modules (none left)
KNOWN_CIRCLES: set[frozenset[str]] = set()


def modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Dotted module name → (file, is a package's ``__init__``)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        if package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, package)
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, package) in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if package else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_finder_sees_a_circle_written_any_way(tmp_path):
    pkg = tmp_path / "pfl"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pfl.a\n")
    (pkg / "d.py").write_text("from . import a\n")
    graph = import_graph(pkg)
    assert graph["pfl.a"] == {"pfl.sub.b"} and graph["pfl.d"] == {"pfl.a"}
    assert circles(graph) == [frozenset({"pfl.a", "pfl.sub.b", "pfl.c"})]


def test_pfl_has_no_import_circle():
    found = [c for c in circles(import_graph()) if c not in KNOWN_CIRCLES]
    assert not found, "import circles: " + "; ".join(" ↔ ".join(sorted(c)) for c in found)
