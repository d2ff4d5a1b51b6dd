"""What each process of a SLURM run holds, where it runs, and what its job asks for: one place for the batch
script (`slurm_job`) and the engine (`engines/slurm`), so that the job always holds what its steps take,
and asks for no GPU that no step uses.

Every process is its own job step with resources of its own (`srun --exact`, never `--overlap`, which
shares CPUs, memory and GPUs with every other step):

- GPUs (`gpus_of`): `cluster.slurm.gpus` for the process or its role, else what it computes on
  (`mas_async.config.gpus_wanted`, the rule of every engine): 1 for a trainer rank or an hf replica on a
  GPU device, `vllm.tensor_parallel_size` for a vLLM replica, else 0. A
  step with GPUs asks `--gpus-per-task=G` and sees only its own, as cuda:0..G-1 (CUDA_VISIBLE_DEVICES);
  one without asks `--gres=none`, since a step gets every GPU of the job on its node by default.
- CPUs: `cluster.slurm.cpus` for the process or its role, else 4 with GPUs and `cluster.torch_threads`
  without (`--cpus-per-task`).
- memory: `--mem=0`: the step may use all of the job's memory on its node, and, as srun documents it ("not
  remove any of the job's memory allocation from being available to other job steps"), takes none of it
  from the other steps, also where memory is a consumable resource (`SelectTypeParameters=CR_Core_Memory`,
  and a `DefMemPerGPU`): tests/integration/test_slurm_memory.py runs every step of a run at once there.

Where (`node_indexes`): `cluster.slurm.placement` for the process or its role; the other steps with GPUs
are packed onto the nodes in start order (a policy's trainer ranks, then its servers), each node filled up
to an even share of all the GPUs before the next (`pack_gpu_steps`), so each policy's trainer and servers
share a node where they fit one (its weight broadcasts stay on the node); the processes without GPUs as
`default_node_index` says.

The job has one task per node and asks every node for `--cpus-per-task=C --gpus-per-node=G --mem=M`, C and
G the most that the processes placed on any one node need together (SLURM asks the same of each node), M
`cluster.slurm.mem_per_node`; with the GPUs spread evenly, G times the nodes is the GPUs the steps use (up
to one less per node where the steps' sizes do not divide evenly). `nodes_for` is the fewest nodes of N
GPUs that hold the steps: one node when everything fits one. Within the job, the steps of one node run
side by side, CPU roles packed beside the GPU ones; the batch step (the launcher) takes nothing from them.
"""

from __future__ import annotations

from dataclasses import dataclass

from mas_async.config import Config, ConfigError, scheduler_gpus
from mas_async.launch.engines.base import ProcessSpec
from mas_async.placement import process_device

GPU_PROCESS_CPUS = 4
"""CPUs of a process with GPUs unless `cluster.slurm.cpus` says (data movement, tokenisation, vLLM's loop)."""

JOB_RESOURCE_ENV = (
    "SLURM_CPUS_PER_GPU", "SLURM_CPUS_PER_TASK", "SLURM_EXACT", "SLURM_EXCLUSIVE", "SLURM_GPUS",
    "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_SOCKET", "SLURM_GPUS_PER_TASK", "SLURM_GRES", "SLURM_MEM_PER_CPU",
    "SLURM_MEM_PER_GPU", "SLURM_MEM_PER_NODE", "SLURM_NTASKS_PER_GPU", "SLURM_OVERLAP", "SLURM_STEP_GRES",
    "SLURM_TRES_PER_TASK", "SRUN_CPUS_PER_TASK",
)  # fmt: skip
"""The job's resource options as sbatch exports them to the batch step: srun would read them as a step's
defaults (every step would ask for all of the node's GPUs; on Slurm 23 and later, the job's
`SLURM_CPUS_PER_TASK` and `SLURM_TRES_PER_TASK=cpu=C` would give every step the whole node's CPUs, or clash
with the step's own `--cpus-per-task`), so a step's srun runs without them."""


@dataclass(frozen=True)
class StepResources:
    """What one step holds on its node (or, summed, what one node's steps hold)."""

    gpus: int = 0
    cpus: int = 0

    def __add__(self, other: StepResources) -> StepResources:
        return StepResources(self.gpus + other.gpus, self.cpus + other.cpus)


def default_node_index(spec: ProcessSpec, nth_of_role: int, node_count: int) -> int:
    """Where a process without GPUs runs unless `cluster.slurm.placement` says: router and trainers on node 0
    (beside the launcher), inference servers round-robin over nodes 1.. (node 0 when it is the only one),
    env workers round-robin over all nodes. Processes with GPUs are packed (`pack_gpu_steps`)."""
    if spec.role == "inference":
        return 1 + nth_of_role % (node_count - 1) if node_count > 1 else 0
    if spec.role == "env_worker":
        return nth_of_role % node_count
    return 0


def pack_gpu_steps(sizes: list[int], used: list[int]) -> list[int]:
    """Node indexes for steps of `sizes` GPUs, in order, on nodes already holding `used` GPUs: each step on
    the first node whose GPUs stay within the share (all the GPUs over the nodes, rounded up), the share
    raised by one until every step fits. A step is never split over nodes."""
    share = -(-(sum(sizes) + sum(used)) // len(used))
    while True:
        held, where = list(used), []
        for size in sizes:
            index = next((i for i, h in enumerate(held) if h + size <= share), None)
            if index is None:
                break
            held[index] += size
            where.append(index)
        if len(where) == len(sizes):
            return where
        share += 1


def node_indexes(config: Config, specs: list[ProcessSpec], node_count: int) -> dict[str, int]:
    """process name -> its node index: `cluster.slurm.placement` (the process, else its role), else the
    steps with GPUs packed (`pack_gpu_steps`) and the others at `default_node_index`; an index outside the
    allocation is a ConfigError."""
    placement = config.cluster.slurm.placement
    seen: dict[str, int] = {}
    where: dict[str, int] = {}
    used = [0] * node_count
    packed: list[tuple[ProcessSpec, int]] = []
    for spec in specs:
        nth = seen[spec.role] = seen.get(spec.role, -1) + 1
        key = spec.name if spec.name in placement else spec.role
        gpus = gpus_of(config, spec)
        if key not in placement and gpus:
            packed.append((spec, gpus))
            continue
        index = placement.get(key, default_node_index(spec, nth, node_count))
        if index >= node_count:
            raise ConfigError(
                f"cluster.slurm.placement.{key}={index}: the allocation has {node_count} nodes, indexes "
                f"0..{node_count - 1}"
            )
        where[spec.name] = index
        used[index] += gpus
    for (spec, _), index in zip(packed, pack_gpu_steps([g for _, g in packed], used), strict=True):
        where[spec.name] = index
    return {spec.name: where[spec.name] for spec in specs}


def _setting(table: dict[str, int], spec: ProcessSpec) -> int | None:
    return table.get(spec.name, table.get(spec.role))


def gpus_of(config: Config, spec: ProcessSpec) -> int:
    """The GPUs of `spec`'s step (module docstring; `config.scheduler_gpus`, the rule every engine shares); a
    device the step would not hold is a ConfigError."""
    device = process_device(config, spec.name)
    gpus = int(scheduler_gpus(config, spec.name) or 0)
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        if index >= gpus:
            held = f"{gpus} GPU(s) of its own, seen as cuda:0..{gpus - 1}" if gpus else "no GPU"
            raise ConfigError(
                f"{spec.name} runs on {device}, but under cluster.engine=slurm its step holds {held} "
                f"(cluster.slurm.gpus.{spec.role}); name its device cuda, or give its step more GPUs"
            )
    return gpus


def step_resources(config: Config, spec: ProcessSpec) -> StepResources:
    """What `spec`'s step holds on its node."""
    gpus = gpus_of(config, spec)
    cpus = _setting(config.cluster.slurm.cpus, spec)
    if cpus is None:
        cpus = GPU_PROCESS_CPUS if gpus else config.cluster.torch_threads
    return StepResources(gpus, cpus)


def node_needs(config: Config, specs: list[ProcessSpec], node_count: int) -> list[StepResources]:
    """What the steps placed on each node (by index) hold together."""
    where = node_indexes(config, specs, node_count)
    needs = [StepResources() for _ in range(node_count)]
    for spec in specs:
        needs[where[spec.name]] += step_resources(config, spec)
    return needs


def job_options(config: Config, specs: list[ProcessSpec], node_count: int) -> list[str]:
    """The job's per-node requests (`#SBATCH` options): the most any one node's steps hold, and memory."""
    needs = node_needs(config, specs, node_count)
    cpus, gpus = max(n.cpus for n in needs), max(n.gpus for n in needs)
    return [
        f"--cpus-per-task={cpus}",
        *([f"--gpus-per-node={gpus}"] if gpus else []),
        f"--mem={config.cluster.slurm.mem_per_node}",
    ]


def nodes_for(config: Config, specs: list[ProcessSpec], gpus_per_node: int | None, nodes: int | None) -> int:
    """The job's node count: `nodes` (`--nodes`) when given, checked against nodes of `gpus_per_node` GPUs
    (`--gpus-per-node`) when that is given too; else the fewest nodes of `gpus_per_node` GPUs that hold the
    steps (at least one past every node index `cluster.slurm.placement` names); else one node. Steps that
    cannot fit are a ConfigError that says what to change."""
    lowest = 1 + max(config.cluster.slurm.placement.values(), default=0)
    if gpus_per_node is None:
        return nodes or lowest
    if gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node={gpus_per_node}: a node has at least one GPU")
    for spec in specs:
        gpus = gpus_of(config, spec)
        if gpus > gpus_per_node:
            raise ConfigError(
                f"{spec.name} needs {gpus} GPUs (cluster.slurm.gpus, or its vllm.tensor_parallel_size), more "
                f"than a node has (--gpus-per-node {gpus_per_node}): a step runs on one node"
            )

    def most_on_a_node(count: int) -> int:
        return max(n.gpus for n in node_needs(config, specs, count))

    if nodes is not None:
        most = most_on_a_node(nodes)
        if most > gpus_per_node:
            needed = nodes_for(config, specs, gpus_per_node, None)
            raise ConfigError(
                f"on {nodes} node(s) the steps need {most} GPUs on one node, more than its {gpus_per_node} "
                f"(--gpus-per-node {gpus_per_node}): leave --nodes out ({needed} nodes hold them), or place "
                f"them with cluster.slurm.placement"
            )
        return nodes
    count = lowest
    while most_on_a_node(count) > gpus_per_node:
        count += 1  # ends: with a node per step, each node holds at most one step, and none is too big
    return count


def step_options(resources: StepResources) -> list[str]:
    """The srun options that give a step exactly `resources` of its node, beside the other steps."""
    gpus = [f"--gpus-per-task={resources.gpus}"] if resources.gpus else ["--gres=none"]
    return ["--exact", f"--cpus-per-task={resources.cpus}", *gpus, "--mem=0"]


def step_environment(environ: dict[str, str]) -> dict[str, str]:
    """`environ` without the job's resource options (`JOB_RESOURCE_ENV`), for a step's srun."""
    return {k: v for k, v in environ.items() if k not in JOB_RESOURCE_ENV}
