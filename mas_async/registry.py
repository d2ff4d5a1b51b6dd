"""Resolve the names in a config to classes: a registry key ("plan_path") or a "module:Class" path.

Registries are plain dicts from key to "module:Class" strings (no import-time magic): envs/__init__.py
holds ENVS, nodes/__init__.py holds NODES and WORKFLOWS. A user's own class plugs in by path, e.g.
`node: "my_pkg.my_nodes:Scout"`, without editing the package. An import error in a user's module is
raised as is: a broken plugin is never hidden.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping


class RegistryError(ValueError):
    """A name in the config names no known class."""


def resolve(name: str, registry: Mapping[str, str], kind: str) -> type:
    """Return the class named by `name`: a key of `registry` or a "module:Class" path."""
    path = registry.get(name, name)
    if ":" not in path:
        known = ", ".join(sorted(registry)) or "(none)"
        raise RegistryError(f"unknown {kind} {name!r}: known {kind}s are {known}, or give a 'module:Class' path")
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise RegistryError(f"{kind} {name!r}: module {module_name!r} has no attribute {attr!r}") from None
