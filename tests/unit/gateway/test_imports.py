"""The gateway's modules import one way: no circle among them, counting every import (those under
TYPE_CHECKING and inside functions too), so that none can come back unseen."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import ROOT

PACKAGE = "mas_async.gateway"


def import_graph(folder: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` (files of `folder`) that it imports anywhere in its source."""
    modules = {f"{package}.{p.stem}": p for p in folder.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        named: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                named.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                named.add(node.module)
                named.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {m for m in named if m in modules and m != name}
    return graph


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph` (its modules in import order, the first again at the end), or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for nxt in sorted(graph[node]):
            found = visit(nxt, [*path, node])
            if found:
                return found
        done.add(node)
        return None

    for start in sorted(graph):
        found = visit(start, [])
        if found:
            return found
    return None


def test_the_gateways_modules_import_one_way() -> None:
    graph = import_graph(ROOT / "mas_async" / "gateway", PACKAGE)
    assert len(graph) > 10
    found = circle(graph)
    assert found is None, " -> ".join(found or [])


def test_a_circle_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from pkg.b import x\n")
    (tmp_path / "b.py").write_text("def f():\n    from pkg import c\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n")
    assert circle(import_graph(tmp_path, "pkg")) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
