"""`mas-async train|eval CONFIG --dry-run`: where every process of a run would go, with nothing started.

The engine places the processes as it would for the run (`Engine.place`; under SLURM outside an
allocation, on `nodes` nodes named by index), `mas_async.placement` decides each process's GPU and each
policy's weight backend, and the sandbox is checked for an env that runs model-written code; a mistake
any of these would make at launch is the same `ConfigError` here. No run directory is written, no port
is taken and no process is started.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from mas_async.deployment import trainer_peer
from mas_async.launch.engines.registry import open_engine
from mas_async.launch.launcher import check_sandbox, place_specs, process_specs
from mas_async.placement import weight_backend_choice

if TYPE_CHECKING:
    from mas_async.config import Config
    from mas_async.launch.engines.base import Engine, ProcessSpec

LISTENS = {"router": "router socket (1 free port, taken at start)"}
"""What a process listens on; the others only connect (deployment.json has the ports once a run starts)."""


def plan_lines(config: Config, training: bool = True, nodes: int = 2) -> list[str]:
    """The plan as printed: one line per process (role, node, address, device, GPU, what it listens on),
    then each policy's model and weight backend with the reason, then the sandbox."""
    check_sandbox(config)
    engine, where = _engine(config, nodes)
    try:
        specs = process_specs(config, training)
        _, places = place_specs(config, engine, specs)
        choices = {p: weight_backend_choice(config, p, places) for p in config.policies} if training else {}
    finally:
        engine.close()
    listens = {**LISTENS, **{trainer_peer(p): "weight and rank stores (2 free ports)" for p in choices}}
    if config.gateway.external:  # each env worker's OpenAI gateway, for an agent service outside the run
        port = config.gateway.port
        for i in range(config.cluster.env_workers):
            listens[f"env_worker/{i}"] = f"OpenAI gateway ({f'port {port + i}' if port else '1 free port'}, run token)"
    slurm = config.cluster.engine == "slurm"
    rows = [("process", "role", "node", "address", "device", "gpu", "listens on", *(("step holds",) if slurm else ()))]
    for spec in specs:
        place = places[spec.name]
        device = place.device or "(its engine picks)"
        row = (spec.name, spec.role, place.node, place.address, device, place.gpu or "-", listens.get(spec.name, "-"))
        rows.append((*row, _step(config, spec)) if slurm else row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    mode = "training" if training else "evaluation"
    lines = [
        f"mas-async: dry run of {config.run.name} ({mode}, engine {config.cluster.engine}{where}); nothing started"
    ]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    for policy, spec in config.policies.items():
        if policy in choices:
            backend, why = choices[policy]
            lines.append(f"policy {policy}: {spec.model}; weights by {backend}: {why}")
        else:
            lines.append(f"policy {policy}: {spec.model}; no weight sync (no trainer)")
    lines.append(f"sandbox: {_sandbox_line(config)}")
    return lines


def _engine(config: Config, nodes: int) -> tuple[Engine, str]:
    """The config's engine, and how the header names where it places; SLURM outside an allocation plans on
    `nodes` nodes, as `mas-async slurm CONFIG --nodes N` would submit."""
    if config.cluster.engine == "slurm" and not os.environ.get("SLURM_JOB_ID"):
        from mas_async.launch.engines.slurm import SlurmEngine

        if nodes < 1:
            from mas_async.config import ConfigError

            raise ConfigError(f"--nodes={nodes}: a job needs at least one node")
        return SlurmEngine.planning(config, nodes), f", outside an allocation: as a job of {nodes} nodes"
    return open_engine(config), ""


def _step(config: Config, spec: ProcessSpec) -> str:
    """What a process's SLURM step holds of its node (`slurm_resources.step_resources`)."""
    from mas_async.launch.slurm_resources import step_resources

    held = step_resources(config, spec)
    return f"{held.gpus} GPU(s) of its own, {held.cpus} CPU(s)" if held.gpus else f"{held.cpus} CPU(s)"


def _sandbox_line(config: Config) -> str:
    from mas_async.api.registry import ENVS, resolve

    if not resolve(config.env.name, ENVS, "env").runs_code:
        return f"env {config.env.name} runs no model-written code"
    if config.sandbox.unsafe_no_isolation:
        return f"env {config.env.name} runs model-written code WITHOUT isolation (sandbox.unsafe_no_isolation)"
    return f"env {config.env.name} runs model-written code in bubblewrap (checked on this machine)"
