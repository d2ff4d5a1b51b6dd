"""`mas-async train|eval CONFIG --dry-run`: where every process of a run would go, with nothing started.

The engine places the processes as it would for the run (`Engine.place`), `mas_async.placement` decides
each process's GPU and each policy's weight backend, and the sandbox is checked for an env that runs
model-written code; a mistake any of these would make at launch is the same `ConfigError` here. No run
directory is written, no port is taken and no process is started.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mas_async.launch.engines.registry import open_engine
from mas_async.launch.launcher import check_sandbox, process_specs
from mas_async.placement import place_processes, weight_backends

if TYPE_CHECKING:
    from mas_async.config import Config


def plan_lines(config: Config, training: bool = True) -> list[str]:
    """The plan as printed: one line per process (node, address, device, GPU), then each policy's weight
    backend and model, then the sandbox."""
    check_sandbox(config)
    engine = open_engine(config)
    try:
        specs = process_specs(config, training)
        placement = engine.place(specs)
        by_name = {spec.name: spec for spec in specs}
        places = place_processes(
            config,
            {name: (node.name, node.address) for name, node in placement.items()},
            lambda name: engine.gpu_view(by_name[name], placement[name]),
            engine.gpu_uuids,
        )
        backends = weight_backends(config, places, training)
    finally:
        engine.close()
    rows = [("process", "node", "address", "device", "gpu")]
    rows += [(n, p.node, p.address, p.device or "(its engine picks)", p.gpu or "-") for n, p in places.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    mode = "training" if training else "evaluation"
    lines = [f"mas-async: dry run of {config.run.name} ({mode}, engine {config.cluster.engine}); nothing started"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    for policy, spec in config.policies.items():
        backend = f"weights by {backends[policy]}" if policy in backends else "no weight sync (no trainer)"
        lines.append(f"policy {policy}: {spec.model}, {backend}")
    lines.append(f"sandbox: {_sandbox_line(config)}")
    return lines


def _sandbox_line(config: Config) -> str:
    from mas_async.api.registry import ENVS, resolve

    if not resolve(config.env.name, ENVS, "env").runs_code:
        return f"env {config.env.name} runs no model-written code"
    if config.sandbox.unsafe_no_isolation:
        return f"env {config.env.name} runs model-written code WITHOUT isolation (sandbox.unsafe_no_isolation)"
    return f"env {config.env.name} runs model-written code in bubblewrap (checked on this machine)"
