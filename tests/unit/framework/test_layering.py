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
