"""Everything a run will import by name, imported once by the launcher before any process starts.

The env class, the workflow class or program (and its scorer), every agent's node class and every policy's
inference backend given as a path are named in the config by registry key or "module:Class" path and imported by the env
workers and servers. A name that does not import would otherwise show only there, after the launcher has
restarted those processes `cluster.max_restarts` times; `check_loadable` imports each here and refuses the run
(a `ConfigError` that names the key, the path and the import's own error), for `train`, `eval` and
`--dry-run` alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mas_async.config import ConfigError

if TYPE_CHECKING:
    from mas_async.config import Config


def check_loadable(config: Config) -> None:
    """Import every class and function the run names (module docstring); ConfigError for the first that fails."""
    from mas_async.api.registry import BACKENDS, ENVS, NODES, WORKFLOWS, resolve
    from mas_async.gateway.loading import load_program, load_scorer

    wf = config.workflow
    names: list[tuple[str, str, Callable[[], Any]]] = [
        ("env.name", config.env.name, lambda: resolve(config.env.name, ENVS, "env"))
    ]
    if wf.program is not None:
        names.append(("workflow.program", wf.program, lambda: load_program(wf.program)))
    if wf.scorer is not None:
        names.append(("workflow.scorer", wf.scorer, lambda: load_scorer(wf.scorer)))
    if wf.name is not None:
        names.append(("workflow.name", wf.name, lambda: resolve(wf.name, WORKFLOWS, "workflow")))
    for agent, spec in config.agents.items():
        if spec.node is not None:
            node = spec.node
            names.append((f"agents.{agent}.node", node, lambda node=node: resolve(node, NODES, "node")))
    for policy, spec in config.policies.items():
        backend = spec.backend
        if backend not in BACKENDS:  # (the shipped ones import their engine, which a login node may lack)
            names.append(
                (f"policies.{policy}.backend", backend, lambda b=backend: resolve(b, BACKENDS, "inference backend"))
            )
    for key, name, load in names:
        try:
            load()
        except (ImportError, ValueError) as error:  # (RegistryError and ProgramError are ValueErrors)
            raise ConfigError(f"{key} {name!r} cannot be loaded: {type(error).__name__}: {error}") from None
