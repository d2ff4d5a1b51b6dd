"""`mas-async train|eval CONFIG --dry-run [--gpus-per-node N] [--json]`: where every process of a run would go,
with nothing started.

The engine places the processes as it would for the run (`Engine.place`; under SLURM outside an
allocation, on `nodes` nodes named by index), the GPUs each holds are planned (`mas_async.gpu_plan`: GPUs of
its own unless the config asks to share), `mas_async.placement` decides each process's GPU and each policy's
weight backend, and the sandbox is checked for an env that runs model-written code; a mistake any of these
would make at launch is the same `ConfigError` here. No run directory is written, no port is taken and no
process is started.

The plan is for the job's nodes, not for the machine the dry run runs on: `--gpus-per-node N` plans for nodes
of N GPUs each (the local engine's one machine, every SLURM or Ray node). Without it the local engine plans
for this machine's GPUs, and where that has none (a login node), or the engine cannot tell (SLURM, Ray), as
if each node had every GPU its processes ask for; the plan says which (`assumed`). `--json` prints the plan
as one JSON object (`plan_json`).

Every process on a GPU gets its memory (`mas_async.launch.memory_plan`): a trainer rank's peak from its own
training step run at the real model shape on fake tensors, a vLLM server's weights, receive buffers and KV cache
under the engine arguments it will really get, each against its GPU's memory (`--gpu-memory-gib`, 80 unless
told) or its share of it; a process that does not fit is the launch's `ConfigError`, here too.
`--prompt-tokens` sets the planned prompts' length (1,024 unless told; a sequence is that plus
`rollout.max_tokens`); `--no-memory-plan` leaves the memory out (seconds instead of a minute or two a policy).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mas_async.config import gpus_wanted
from mas_async.inference.backends.vllm_args import engine_args
from mas_async.launch.engines.registry import open_engine
from mas_async.launch.launcher import check_sandbox, place_specs, process_specs
from mas_async.launch.loadable import check_loadable
from mas_async.launch.memory_plan import DEFAULT_GPU_GIB, GIB, ProcessMemory, check_memory, on_gpu, plan_memory
from mas_async.peer_names import trainer_peer, trainer_rank
from mas_async.placement import SELF_PLACED, Place, weight_backend_choice

if TYPE_CHECKING:
    from collections.abc import Callable

    from mas_async.config import Config
    from mas_async.launch.engines.base import Engine, ProcessSpec

LISTENS = {"router": "router socket (1 free port, taken at start)"}
"""What a process listens on; the others only connect (deployment.json has the ports once a run starts)."""
VLLM_DEVICE = "(vllm)"
"""The device column of a vLLM server on GPUs: it is handed no device and computes on the GPUs it sees."""


@dataclass
class DryPlan:
    """Everything a dry run found: the processes in start order, their places, each policy's weight backend."""

    config: Config
    training: bool
    where: str
    """How the header names where the engine places (", outside an allocation: as a job of 2 nodes")."""
    gpus_per_node: int | None
    assumed: str
    """What the plan assumed about the nodes' GPUs, in a sentence."""
    specs: list[ProcessSpec]
    places: dict[str, Place]
    choices: dict[str, tuple[str, str]]
    """policy -> (weight backend, why); empty without training."""
    listens: dict[str, str]
    steps: dict[str, str]
    """process -> what its SLURM step holds (SLURM only)."""
    memory: dict[str, ProcessMemory]
    """GPU process -> its memory figure (`memory_plan`); empty where it was not planned."""
    memory_words: str
    """What the memory plan assumed, or why there is none, in a sentence ("" without a GPU process)."""


@dataclass(frozen=True)
class MemoryAsk:
    """How the dry run plans memory: the GPUs' memory (GiB; None: `DEFAULT_GPU_GIB`, said in the plan), the
    planned prompts' tokens, and whether to plan it at all."""

    gpu_memory_gib: float | None = None
    prompt_tokens: int = 1024
    plan: bool = True


def dry_plan(
    config: Config,
    training: bool = True,
    nodes: int = 2,
    gpus_per_node: int | None = None,
    memory: MemoryAsk | None = None,
) -> DryPlan:
    """The run's plan (module docstring), refused with the ConfigError a launch would raise."""
    check_loadable(config)
    check_sandbox(config)
    engine, where = _engine(config, nodes)
    try:
        specs = process_specs(config, training)
        count, assumed = _gpu_count(config, engine, specs, gpus_per_node)
        # The job's nodes are not this machine: their GPUs' UUIDs are unknown here.
        uuids = (lambda view: None) if gpus_per_node is not None else None
        _, places = place_specs(config, engine, specs, count, uuids)
        choices = {p: weight_backend_choice(config, p, places) for p in config.policies} if training else {}
    finally:
        engine.close()
    listens = {**LISTENS, **{trainer_peer(p): "weight and rank stores (2 free ports)" for p in choices}}
    if config.gateway.external:  # each env worker's OpenAI gateway, for an agent service outside the run
        port = config.gateway.port
        for i in range(config.cluster.env_workers):
            listens[f"env_worker/{i}"] = f"OpenAI gateway ({f'port {port + i}' if port else '1 free port'}, run token)"
    steps = {spec.name: _step(config, spec) for spec in specs} if config.cluster.engine == "slurm" else {}
    planned, words = _memory(config, places, training, memory or MemoryAsk())
    return DryPlan(
        config, training, where, gpus_per_node, assumed, specs, places, choices, listens, steps, planned, words
    )


def _memory(
    config: Config, places: dict[str, Place], training: bool, ask: MemoryAsk
) -> tuple[dict[str, ProcessMemory], str]:
    """The GPU processes' memory and what it assumed, refused where one does not fit (`memory_plan`)."""
    if not any(on_gpu(place) for place in places.values()):
        return {}, ""
    if not ask.plan:
        return {}, "not planned (--no-memory-plan)"
    from mas_async.config import ConfigError
    from mas_async.model_source import ModelSourceError

    gib = ask.gpu_memory_gib if ask.gpu_memory_gib is not None else DEFAULT_GPU_GIB
    if gib <= 0:
        raise ConfigError(f"--gpu-memory-gib={gib:g}: a GPU has some memory (80 for an H100)")
    told = "--gpu-memory-gib" if ask.gpu_memory_gib is not None else "assumed: --gpu-memory-gib G to say"
    words = (
        f"GPUs of {gib:g} GiB ({told}); sequences of {ask.prompt_tokens} prompt + {config.rollout.max_tokens} "
        f"completion tokens (--prompt-tokens); a trainer's figure is its step's peak + 5% + 2 GiB"
    )
    try:
        planned = plan_memory(config, places, int(gib * GIB), ask.prompt_tokens, training=training)
    except ModelSourceError as e:
        return {}, f"not planned: {e}"
    check_memory(planned, f"GPUs of {gib:g} GiB, {told}")
    return planned, words


def plan_lines(
    config: Config,
    training: bool = True,
    nodes: int = 2,
    gpus_per_node: int | None = None,
    memory: MemoryAsk | None = None,
) -> list[str]:
    """The plan as printed: what it assumed of the nodes' GPUs, one line per process (role, node, address,
    device, the node's GPUs it holds, its GPU, what it listens on), then each GPU process's memory and each vLLM
    server's engine arguments, then each policy's model and weight backend with the reason, then the sandbox."""
    plan = dry_plan(config, training, nodes, gpus_per_node, memory)
    slurm = bool(plan.steps)
    header = ("process", "role", "node", "address", "device", "gpus", "gpu", "listens on")
    rows = [(*header, *(("step holds",) if slurm else ()))]
    for spec in plan.specs:
        place = plan.places[spec.name]
        device = VLLM_DEVICE if place.device == SELF_PLACED else place.device
        gpus = ",".join(map(str, place.gpus)) or "-"
        row = (spec.name, spec.role, place.node, place.address, device, gpus, place.gpu or "-")
        row += (plan.listens.get(spec.name, "-"),)
        rows.append((*row, plan.steps[spec.name]) if slurm else row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    mode = "training" if training else "evaluation"
    lines = [
        f"mas-async: dry run of {config.run.name} ({mode}, engine {config.cluster.engine}{plan.where}); nothing started"
    ]
    if plan.assumed:
        lines.append(f"GPUs: {plan.assumed}")
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if any(place.cuda_visible_devices for place in plan.places.values()):
        lines.append(
            "gpus: the node's GPUs a process holds; a process of device cuda and a vLLM server see only theirs "
            "(CUDA_VISIBLE_DEVICES=gpus), as cuda:0.."
        )
    if plan.memory_words:
        lines.append(f"memory: {plan.memory_words}")
    for memory in plan.memory.values():
        lines.append(f"  {memory.line()}")
        if memory.engine_args is not None:
            lines.append(f"    engine_args: {memory.engine_args}")
    for policy, spec in config.policies.items():
        if policy in plan.choices:
            backend, why = plan.choices[policy]
            lines.append(f"policy {policy}: {spec.model}; weights by {backend}: {why}")
        else:
            lines.append(f"policy {policy}: {spec.model}; no weight sync (no trainer)")
    lines.append(f"sandbox: {_sandbox_line(config)}")
    return lines


def plan_json(
    config: Config,
    training: bool = True,
    nodes: int = 2,
    gpus_per_node: int | None = None,
    memory: MemoryAsk | None = None,
) -> dict[str, Any]:
    """The plan as one JSON object:

    run, mode ("training" | "evaluation"), engine, gpus_per_node (--gpus-per-node, or null), assumed (what
    the plan took the nodes' GPUs to be), processes: a list in start order of {name, role, policy, rank
    (trainer) | replica (inference) | index (env worker), node, address, device (as the process names it:
    "cpu", "cuda:N"; null for a vLLM server on GPUs, which is handed none), gpus (indices of its node's GPUs
    it holds), gpu (the GPU's identity, `mas_async.placement`), cuda_visible_devices (what the launcher
    sets; null for none), share (its GPU memory share, or null), listens (or null), engine_args (a vLLM
    server's, as vLLM will be given them where its memory was planned), memory (a GPU process's: need_gib,
    room_gib, fits, room, parts_gib, note; where planned), step (SLURM: what its step holds)}, memory (what the
    plan assumed, or why there is none), policies: {name: {model, backend, weight_backend (null without
    training), reason}}, sandbox.
    """
    plan = dry_plan(config, training, nodes, gpus_per_node, memory)
    processes = []
    for spec in plan.specs:
        place = plan.places[spec.name]
        row: dict[str, Any] = {"name": spec.name, "role": spec.role, "policy": spec.policy or None}
        if spec.role == "trainer":
            row["rank"] = trainer_rank(spec.name)
        elif spec.role == "inference":
            row["replica"] = int(spec.name.rsplit("/", 1)[1])
        elif spec.role == "env_worker":
            row["index"] = int(spec.name.rsplit("/", 1)[1])
        row |= {
            "node": place.node,
            "address": place.address,
            "device": None if place.device == SELF_PLACED else place.device,
            "gpus": list(place.gpus),
            "gpu": place.gpu or None,
            "cuda_visible_devices": place.cuda_visible_devices or None,
            "share": place.share,
            "listens": plan.listens.get(spec.name),
        }
        planned = plan.memory.get(spec.name)
        if spec.role == "inference" and config.policies[spec.policy].backend == "vllm":
            given = planned.engine_args if planned is not None else None
            row["engine_args"] = given if given is not None else engine_args(config, spec.name)
        if planned is not None:
            row["memory"] = planned.as_json()
        if plan.steps:
            row["step"] = plan.steps[spec.name]
        processes.append(row)
    policies = {}
    for policy, spec in config.policies.items():
        backend, why = plan.choices.get(policy, (None, "no trainer: no weight sync"))
        policies[policy] = {"model": spec.model, "backend": spec.backend, "weight_backend": backend, "reason": why}
    return {
        "run": config.run.name,
        "mode": "training" if training else "evaluation",
        "engine": config.cluster.engine + plan.where,
        "gpus_per_node": gpus_per_node,
        "assumed": plan.assumed or None,
        "processes": processes,
        "memory": plan.memory_words or None,
        "policies": policies,
        "sandbox": _sandbox_line(config),
    }


def format_plan_json(plan: dict[str, Any]) -> str:
    """`plan_json`'s object as JSON text: one line per process and per policy, so the plan reads as a table."""
    lines = ["{"]
    for i, (key, value) in enumerate(plan.items()):
        end = "," if i < len(plan) - 1 else ""
        if key == "processes":
            rows = [f"    {json.dumps(row)}" for row in value]
            lines += [f'  "{key}": [', ",\n".join(rows), f"  ]{end}"]
        elif key == "policies":
            rows = [f"    {json.dumps(name)}: {json.dumps(row)}" for name, row in value.items()]
            lines += [f'  "{key}": {{', ",\n".join(rows), f"  }}{end}"]
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}{end}")
    return "\n".join([*lines, "}"])


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


def _gpu_count(
    config: Config, engine: Engine, specs: list[ProcessSpec], gpus_per_node: int | None
) -> tuple[Callable[[str], int | None], str]:
    """How many GPUs each node (or machine) of the plan has, and what that assumed, in a sentence ("" when the
    run holds no GPU)."""
    if gpus_per_node is not None:
        if gpus_per_node < 0:
            from mas_async.config import ConfigError

            raise ConfigError(f"--gpus-per-node={gpus_per_node}: a node has 0 GPUs or more")
        each = f"{gpus_per_node} GPU" + ("" if gpus_per_node == 1 else "s")
        return (lambda pool: gpus_per_node), f"planned for nodes of {each} each (--gpus-per-node)"
    if not any(gpus_wanted(config, spec.name) for spec in specs):
        return engine.gpu_count, ""
    hint = "--gpus-per-node N plans for nodes of N GPUs"
    if config.cluster.engine == "local":
        here = engine.gpu_count("")  # the local engine's one pool: this machine
        if here:
            return engine.gpu_count, f"planned for this machine's {here} GPUs ({hint} instead)"
        return (lambda pool: None), (
            "this machine has no GPU, so the plan assumes that the node it runs on has every GPU its processes ask "
            f"for (vLLM servers on GPUs, not the CPU); {hint}"
        )
    return (lambda pool: None), f"the plan assumes that each node has every GPU its processes ask for; {hint}"


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
