"""The package's arrows point one way: the framework imports user packages (envs, nodes) only through
the registry's "module:Class" strings, and user packages import only the framework API."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import ROOT


def _imports(path: Path) -> list[str]:
    """Every module a file imports (also inside functions and TYPE_CHECKING blocks)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _violations(package: str, forbidden) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path):
            if forbidden(name):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


def _top(name: str) -> str:
    return name.split(".")[0]


def test_the_framework_never_imports_user_packages_or_benchmarks():
    assert _violations("mas_async", lambda name: _top(name) in ("envs", "nodes", "bench", "tests")) == []


def test_user_packages_import_only_the_framework_api():
    def outside_api(name: str) -> bool:
        return _top(name) == "mas_async" and not (name == "mas_async.api" or name.startswith("mas_async.api."))

    assert _violations("envs", outside_api) == []
    assert _violations("nodes", outside_api) == []


def test_the_api_imports_no_other_layer_but_the_config_and_the_sandbox():
    # The sandbox is a framework service that envs use: the API hands it over (mas_async/api/sandbox.py).
    allowed = ("mas_async.api", "mas_async.config", "mas_async.sandbox")
    assert _violations("mas_async/api", lambda n: _top(n) == "mas_async" and not n.startswith(allowed)) == []


def test_the_walker_sees_imports_inside_functions_and_type_checking_blocks(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import envs.x\ndef f():\n    from nodes import y\n"
    )
    assert {"envs.x", "nodes"} <= set(_imports(module))


def test_every_framework_module_imports():
    """A moved module whose importers were not updated fails here, not in a process at run time."""
    import importlib
    import importlib.util
    import pkgutil

    import mas_async

    has_vllm = importlib.util.find_spec("vllm") is not None
    failed = []
    for module in pkgutil.walk_packages(mas_async.__path__, "mas_async."):
        if module.name.endswith("__main__") or (".vllm" in module.name and not has_vllm):
            continue
        try:
            importlib.import_module(module.name)
        except Exception as e:  # collected, so one run names every broken module
            failed.append(f"{module.name}: {type(e).__name__}: {e}")
    assert failed == []


def test_benchmarks_use_the_installed_packages_public_face():
    """No bench edits `sys.path` (but the GPU checks, `gpu_*.py`, which run on a bare machine where nothing is
    installed) or imports a private name (a module or a name with a leading underscore)."""
    found = []
    for path in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            modules: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                modules = [node.module or "", *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            found += [f"{path.name} imports {m}" for m in modules if any(p.startswith("_") for p in m.split("."))]
            if not path.name.startswith("gpu_") and (
                isinstance(node, ast.Attribute)
                and node.attr == "path"
                and isinstance(node.value, ast.Name)
                and node.value.id == "sys"
            ):
                found.append(f"{path.name} uses sys.path (line {node.lineno})")
    assert found == []


PROJECT = ("mas_async", "envs", "nodes", "bench")
"""The packages whose modules may not import each other in a circle."""


def _project_modules(root: Path, packages: tuple[str, ...] = PROJECT) -> dict[str, Path]:
    """Every module of `packages` under `root` by dotted name (a package by its `__init__.py`)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _import_graph(root: Path, packages: tuple[str, ...] = PROJECT) -> dict[str, dict[str, int]]:
    """module -> {project module it imports: the line of the first such import}. Every `import` and
    `from ... import` counts, inside functions and `TYPE_CHECKING` blocks too. `import a.b` and `from a import b`
    point at the module `a.b` where there is one, else at the longest known prefix (`from a import name` at
    `a`, the package's `__init__` when `a` is a package: importing from a package runs it); relative imports
    are resolved against the importing module's package. Importing `a.b.c` also runs the `__init__` of `a` and
    `a.b`, but that is no arrow: counted, every package that re-exports its own submodules would be a circle."""
    modules = _project_modules(root, packages)

    def known(name: str) -> str | None:
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) or None

    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [known(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
                targets = [known(f"{base}.{alias.name}") for alias in node.names]  # the module `name`, else `base`
            for target in targets:
                if target is not None and target != name:
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
        graph[name] = edges
    return graph


def _circles(graph: dict[str, dict[str, int]]) -> list[str]:
    """Each strongly connected component of more than one module, named with the arrows inside it."""

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reached = {module: reach(module) for module in graph}
    components = {frozenset(m for m in reached[v] if v in reached[m]) for v in graph if v in reached[v]}
    return sorted(
        " <-> ".join(sorted(c))
        + ": "
        + ", ".join(f"{a} -> {b} (line {line})" for a in sorted(c) for b, line in sorted(graph[a].items()) if b in c)
        for c in components
    )


def test_no_import_circle_between_the_projects_modules():
    """The arrows point one way between modules too, not only between layers (DESIGN section 8): no module of
    mas_async, envs, nodes or bench reaches itself through its imports. A function-level import that closes a
    circle counts (it only defers the circle to the call), and so does an import under `TYPE_CHECKING`: it never
    runs, but the annotation is an arrow of the design all the same (the module cannot move below the one it
    names). A registry's "module:Class" string is no import: that is how the framework reaches user code."""
    circles = _circles(_import_graph(ROOT))
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_circle_check_finds_circles_and_not_a_package_reexporting_its_own_modules(tmp_path):
    files = {
        # A package re-exporting its submodules, which import each other through the package path: no circle.
        "pkg/__init__.py": "from pkg.a import A\nfrom pkg.b import B\n",
        "pkg/a.py": "from pkg.b import B\n",
        "pkg/b.py": "B = 1\n",
        # A lazy import and a relative one close a circle; a TYPE_CHECKING one closes another below.
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "def f():\n    from .d import D\n",
        "pkg/sub/d.py": "from pkg.sub import c\nD = 1\n",
        "pkg/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import B\n",
        "pkg/f.py": "import pkg.e\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = _import_graph(tmp_path, ("pkg",))
    assert graph["pkg.sub.c"] == {"pkg.sub.d": 2} and graph["pkg.e"] == {"pkg": 3}
    assert _circles(graph) == [
        "pkg.sub.c <-> pkg.sub.d: pkg.sub.c -> pkg.sub.d (line 2), pkg.sub.d -> pkg.sub.c (line 1)"
    ]
    (tmp_path / "pkg/__init__.py").write_text("from pkg.f import F\n")  # the package now runs f, which imports e
    assert _circles(_import_graph(tmp_path, ("pkg",)))[0].startswith("pkg <-> pkg.e <-> pkg.f: ")
