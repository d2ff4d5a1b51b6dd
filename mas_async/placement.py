"""Placement: where each process of a run is (its node, its GPU), and the decisions that follow from it.

The config states wishes (a policy's `device`, `server_device`, `trainer_devices`, `vllm`, `cluster.gpu_shares`,
`cluster.weight_backend`); the engine places the processes on nodes (`Engine.place`) and the GPUs each one
holds are planned (`mas_async.gpu_plan`: GPUs of its own unless the config asks to share). Once they are,
the launcher records one `Place` per process in deployment.json and decides here, once, what depends on
placement:

- a process's GPU is an identity string that two processes share exactly when they use one physical
  GPU: the GPU's UUID where the engine can tell it before the processes start (the local engine asks this
  machine), else `<view>/cuda:N`, where the view is the engine's name for the GPUs the process numbers
  from (`Engine.gpu_view`: a node's, one machine's, or a process's own when SLURM or Ray gives it GPUs);
- which weight backend each policy uses (`weight_backend`): gloo when any of the trainer (rank 0) and the
  servers is on the CPU, CUDA IPC when the trainer and every (hf) server of the policy use one GPU, NCCL
  when no two of them share a GPU (other GPUs, other nodes), gloo where two share one otherwise (nothing
  else joins them). An explicit `cluster.weight_backend` that the placement cannot carry is a
  `ConfigError` naming the policy.

The processes check the facts again when a weight group forms (`check_group_gpus`): every rank reports the
UUID of the GPU it actually uses, and a placement the engine got wrong (two NCCL ranks on one GPU, CUDA
IPC between two GPUs) stops the group with an error that names the ranks, their GPUs and their hosts.

`python -m mas_async.placement [RUN_DIR]` prints a run's places and weight backends (its deployment.json),
or, without a run, this machine's GPUs by UUID (what the local engine records).

Below the deployment (`mas_async.deployment` records what is decided here, and falls back on `one_machine`
for a deployment built by hand), above the config, the GPU plan and the peer names it reads.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mas_async.config import ConfigError
from mas_async.peer_names import trainer_peer, trainer_rank

if TYPE_CHECKING:
    import torch.distributed as dist

    from mas_async.config import Config
    from mas_async.gpu_plan import GpuPlace

SELF_PLACED = ""
"""The device of a process that is never handed one (a vLLM server on GPUs: it picks among its own)."""


@dataclass(frozen=True)
class Place:
    """Where one process runs, as deployment.json records it."""

    node: str
    """The engine's name of its node."""
    address: str
    """The address it binds its listeners to and advertises."""
    device: str = "cpu"
    """The device as the process names it: "cpu", "cuda:N", or "" (SELF_PLACED) for a vLLM server on GPUs."""
    gpu: str = ""
    """Which physical GPU (its first): its UUID, or `<view>/cuda:N` where the UUID is not known before the
    process starts; "" for a process on the CPU, or a vLLM server whose GPU nobody planned (`one_machine`)."""
    gpus: tuple[int, ...] = ()
    """The GPUs it holds, as indices of its node's GPUs (`mas_async.gpu_plan`): those the local engine gives it
    or its device names; under SLURM and Ray the planned ones (the scheduler picks which, as many). ()."""
    cuda_visible_devices: str = ""
    """The CUDA_VISIBLE_DEVICES the launcher gives it (the local engine's processes with GPUs of their own);
    "" leaves its environment as it is."""
    share: float | None = None
    """The share of its GPUs' memory it keeps to where it may share them (`cluster.gpu_shares`); None: its own."""


def process_device(config: Config, name: str, gpus: GpuPlace | None = None) -> str:
    """The device process `name` (trainer/P[/R], inference/P/I, router, env_worker/I) names for itself; with
    its planned `gpus`, a vLLM server that holds none runs on the CPU."""
    role, *rest = name.split("/")
    if role == "trainer":
        return config.trainer_device(rest[0], trainer_rank(name))
    if role == "inference":
        device = config.policies[rest[0]].servers_on()
        if device is None and gpus is not None and not gpus.gpus:
            return "cpu"
        return device or SELF_PLACED
    return "cpu"


def gpu_identity(view: str, device: str, uuids: list[str] | None) -> str:
    """The GPU identity of `device` seen from `view` (module docstring); "" for the CPU or a self-placed one."""
    if device in ("cpu", SELF_PLACED):
        return ""
    index = int(device.partition(":")[2] or 0)
    if uuids is not None and index < len(uuids):
        return uuids[index]
    return f"{view}/cuda:{index}"


def place_processes(
    config: Config,
    nodes: dict[str, tuple[str, str]],
    gpu_view: Callable[[str], str],
    gpu_uuids: Callable[[str], list[str] | None] = lambda view: None,
    plan: dict[str, GpuPlace] | None = None,
) -> dict[str, Place]:
    """Every process's `Place`: `nodes` is process name -> (node name, address) as the engine placed it,
    `gpu_view(name)` the view its GPU numbering belongs to, `gpu_uuids(view)` that view's GPU UUIDs in
    CUDA order where known, `plan` the GPUs each holds (`mas_async.gpu_plan.plan_gpus`; None: each uses the
    device its config names, as processes that no engine started do)."""
    places = {}
    for name, (node, address) in nodes.items():
        planned = plan.get(name) if plan is not None else None
        device = process_device(config, name, planned)
        # The GPU it computes on, in its view's numbering: what its device names; for a vLLM server (no
        # device) its first GPU, of its own (cuda:0) or, where the local engine gave them, of the machine's.
        on = device
        if planned is not None and planned.gpus and (device == SELF_PLACED or planned.cuda_visible_devices):
            on = f"cuda:{planned.gpus[0]}" if planned.cuda_visible_devices else "cuda:0"
        view = gpu_view(name) if on not in ("cpu", SELF_PLACED) else ""
        gpu = gpu_identity(view, on, gpu_uuids(view) if view else None)
        if planned is None:
            places[name] = Place(node, address, device, gpu)
        else:
            places[name] = Place(node, address, device, gpu, planned.gpus, planned.cuda_visible_devices, planned.share)
    return places


def replica_names(config: Config, policy: str, training: bool = True) -> list[str]:
    """The peer ids of `policy`'s own inference replicas, inference/P/R (none when it is served on another
    policy's base, `policies.<p>.base`)."""
    if config.server_policy(policy, training) != policy:
        return []
    return [f"inference/{policy}/{r}" for r in range(config.policies[policy].replicas)]


def one_machine(config: Config, training: bool = True, machine: str = "local") -> dict[str, Place]:
    """The places of a deployment that names no nodes: every process on one node, numbering one machine's GPUs."""
    names = ["router"]
    for policy, spec in config.policies.items():
        names += [trainer_peer(policy, r) for r in range(spec.trainer_ranks if training else 0)]
        names += replica_names(config, policy, training)
    names += [f"env_worker/{i}" for i in range(config.cluster.env_workers)]
    return place_processes(config, dict.fromkeys(names, (machine, "127.0.0.1")), lambda name: machine)


def group_members(config: Config, policy: str) -> tuple[str, list[str]]:
    """The processes of `policy`'s weight group: its trainer rank 0, and the replicas that serve it (its base's)."""
    return trainer_peer(policy, 0), replica_names(config, config.server_policy(policy))


def weight_backend(
    config: Config, policy: str, places: dict[str, Place], cuda_available: Callable[[], bool] | None = None
) -> str:
    """How `policy`'s trainer sends its weights to its servers (`weight_backend_choice`)."""
    return weight_backend_choice(config, policy, places, cuda_available)[0]


def weight_backend_choice(
    config: Config, policy: str, places: dict[str, Place], cuda_available: Callable[[], bool] | None = None
) -> tuple[str, str]:
    """How `policy`'s trainer sends its weights to its servers, and why, from where they are (module docstring):
    `cluster.weight_backend` when the placement can carry it (else a ConfigError), or, for auto:

        any of its trainer and servers on the CPU               gloo      (NCCL and CUDA IPC join GPUs only)
        trainer and every (hf) server on one GPU                cuda_ipc  (NCCL refuses two ranks on one GPU)
        no two of them on one GPU (other GPUs, other nodes)     nccl
        two of them on one GPU otherwise                        gloo      (through host memory)

    A vLLM server whose GPUs nobody planned (a deployment that no engine placed, `one_machine`) is taken to
    be on a GPU of its own where CUDA exists (`cuda_available`), else on the CPU.
    """
    choice = config.cluster.weight_backend
    trainer_name, server_names = group_members(config, policy)
    trainer = places[trainer_name]
    servers = [places[name] for name in server_names]
    members = [(trainer_name, trainer), *zip(server_names, servers, strict=True)]
    self_placed = any(s.device == SELF_PLACED for s in servers)
    available = cuda_available or _cuda_available
    on_cpu = [name for name, place in members if _on_cpu(place, available)]
    one_gpu = bool(trainer.gpu) and all(s.gpu == trainer.gpu for s in servers)
    shared = _shared(members)
    if choice == "cuda_ipc" and (not one_gpu or self_placed):
        where = "its vllm servers take no CUDA IPC" if self_placed else _where(members)
        raise ConfigError(
            f"cluster.weight_backend=cuda_ipc shares GPU memory between a trainer and hf servers on one GPU, but for "
            f"policy {policy!r} {where}; use cluster.weight_backend=auto (or gloo)"
        )
    if choice == "nccl" and on_cpu:
        raise ConfigError(
            f"cluster.weight_backend=nccl cannot join policy {policy!r}'s weight group: {on_cpu[0]} is on the CPU, "
            "and NCCL joins GPUs only; use cluster.weight_backend=auto (or gloo)"
        )
    if choice == "nccl" and shared:
        raise ConfigError(
            f"cluster.weight_backend=nccl cannot join policy {policy!r}'s weight group: NCCL refuses two ranks on "
            f"one GPU ({shared}); use cluster.weight_backend=auto (CUDA IPC on one GPU) or gloo"
        )
    if _serves_guests(config, policy) and (choice == "cuda_ipc" or (choice == "auto" and one_gpu and not on_cpu)):
        base = config.policies[policy].base
        raise ConfigError(
            f"policies.{policy}.base={base}: a shared base receives its policies' weights over gloo or nccl, not "
            f"CUDA IPC ({_where(members)}); put the servers on another device (server_device) or use "
            "cluster.weight_backend=gloo"
        )
    if choice != "auto":
        return choice, f"cluster.weight_backend={choice}"
    if on_cpu:
        if len(on_cpu) == len(members):
            return "gloo", "its trainer and servers are on the CPU"
        return "gloo", f"{', '.join(on_cpu)} {'is' if len(on_cpu) == 1 else 'are'} on the CPU (NCCL joins GPUs only)"
    if one_gpu and not self_placed:
        return "cuda_ipc", f"its trainer and every server are on one GPU ({_gpu_of(trainer)})"
    if shared:
        why = "; vLLM takes no CUDA IPC" if self_placed else ""
        return "gloo", f"NCCL refuses two ranks on one GPU ({shared}{why})"
    if self_placed and any(not s.gpu for s in servers):
        return "nccl", "its vllm servers place themselves on GPUs"
    return "nccl", "no two of its trainer and servers are on one GPU"


def _on_cpu(place: Place, cuda_available: Callable[[], bool]) -> bool:
    """Is the process on the CPU? A vLLM server whose GPUs nobody planned is where CUDA exists or not."""
    if place.device == SELF_PLACED and not place.gpu:
        return not cuda_available()
    return place.device == "cpu"


def weight_backends(
    config: Config, places: dict[str, Place], training: bool = True, cuda_available: Callable[[], bool] | None = None
) -> dict[str, str]:
    """policy -> its weight backend (`weight_backend`); none without training (no trainer sends weights)."""
    return {p: weight_backend(config, p, places, cuda_available) for p in config.policies} if training else {}


def _serves_guests(config: Config, policy: str) -> bool:
    """Is `policy` served on another policy's servers (`policies.<p>.base`)?"""
    return config.server_policy(policy) != policy


def _shared(members: list[tuple[str, Place]]) -> str:
    """'A and B on GPU' for the first two members on one GPU, "" if none."""
    first: dict[str, str] = {}
    for name, place in members:
        if place.gpu and place.gpu in first:
            return f"{first[place.gpu]} and {name} on {_gpu_of(place)}"
        first.setdefault(place.gpu, name)
    return ""


def _gpu_of(place: Place) -> str:
    """'cuda:0 of node n1' (in the node's numbering where the local engine gave the process GPUs of its own),
    with the GPU's UUID where known (a view's slot has a '/', a UUID none)."""
    index = f"cuda:{place.gpus[0]}" if place.cuda_visible_devices else place.device or "a GPU of its own"
    return f"{index} of node {place.node}" + (f" (GPU {place.gpu})" if "/" not in place.gpu else "")


def _where(members: list[tuple[str, Place]]) -> str:
    (_, trainer), servers = members[0], members[1:]
    if not servers:
        return "it has no servers"
    on = sorted({_gpu_of(s) if s.gpu else s.device for _, s in servers})
    mine = _gpu_of(trainer) if trainer.gpu else trainer.device
    if (
        trainer.gpu
        and all(s.gpu != trainer.gpu for _, s in servers)
        and trainer.device in {s.device for _, s in servers}
    ):
        return (
            f"its trainer is on {mine} and its servers on {', '.join(on)}: one device name, other GPUs (another node, "
            "or a process the engine gives GPUs of its own)"
        )
    return f"its trainer is on {mine} and its servers on {', '.join(on)}"


def _cuda_available() -> bool:
    """Does this process see a GPU? Asked through NVML (`torch.cuda.device_count` before CUDA is initialised),
    not `torch.cuda.is_available`, which poisons fork for the process on a CUDA build: an inference server of
    a deployment without weight backends asks this before its vLLM engine starts (docs/vllm.md, "Fork safety")."""
    import torch

    return torch.cuda.device_count() > 0


# --- the facts as the processes see them: checked when a weight group forms ----------------------------


class PlacementError(RuntimeError):
    """The processes of a weight group are not where the deployment placed them: the backend it chose
    cannot join them (names the ranks, their GPUs and hosts)."""


def this_gpu() -> str:
    """The UUID of this process's GPU ("" without CUDA): what it reports to its group. The GPU it was placed on
    (`devices.process_device`: asked from a worker thread, whose current device is cuda:0), else the calling
    thread's current device (a vLLM worker's, which its engine made current)."""
    import torch

    from mas_async.devices import gpu_id, process_device

    placed = process_device()
    if placed is not None:
        return gpu_id(placed)
    if not torch.cuda.is_available():
        return ""
    return gpu_id(torch.device("cuda", torch.cuda.current_device()))


def check_group_gpus(
    store: dist.Store, policy: str, backend: str, rank: int, world_size: int, timeout_s: float, gpu: str | None = None
) -> None:
    """The check of a forming weight group of `policy` against the GPUs its ranks actually use: each rank
    writes its GPU (`gpu`, default `this_gpu()`) and host to the group's store. nccl: every rank reads every
    other's and refuses two ranks on one GPU. cuda_ipc: each server (rank >= 1) reads the trainer's (rank 0
    hosts the store, so its key is there first) and refuses another GPU; rank 0 does not wait (it opens its
    side before the servers join). Other backends join anything. Within `timeout_s`; PlacementError names
    the ranks, their GPUs and hosts."""
    if backend not in ("nccl", "cuda_ipc"):
        return
    mine = this_gpu() if gpu is None else gpu
    store.set(f"gpus/{rank}", f"{mine} {socket.gethostname()}")
    if backend == "cuda_ipc" and rank == 0:
        return
    ranks = range(world_size) if backend == "nccl" else (0, rank)
    keys = [f"gpus/{r}" for r in ranks]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if time.monotonic() > deadline:
            raise PlacementError(
                f"rank {rank} of policy {policy!r}'s weight group ({backend}): not every rank said which GPU it "
                f"uses within {timeout_s:g}s"
            )
        time.sleep(0.02)
    facts = {r: store.get(key).decode().split(" ", 1) for r, key in zip(ranks, keys, strict=True)}
    said = ", ".join(f"rank {r}: {gpu or 'no GPU'} on {host}" for r, (gpu, host) in facts.items())
    if backend == "nccl":
        first: dict[str, int] = {}
        for r, (g, _) in facts.items():
            if g and g in first:
                raise PlacementError(
                    f"policy {policy!r}'s weight group (nccl): ranks {first[g]} and {r} use one GPU, which NCCL "
                    f"cannot join ({said}); the deployment took them for two GPUs: set cluster.weight_backend=gloo, "
                    "or give each process its own GPU"
                )
            first.setdefault(g, r)
    elif facts[0][0] != facts[rank][0]:
        raise PlacementError(
            f"policy {policy!r}'s weight group (cuda_ipc) maps the trainer's GPU memory, but rank {rank} is not "
            f"on the trainer's GPU ({said}): the deployment took them for one GPU; set cluster.weight_backend=nccl"
        )


def main(argv: list[str] | None = None) -> int:
    """Print a run's places and weight backends, or this machine's GPUs by UUID."""
    args = sys.argv[1:] if argv is None else argv
    if args:
        deployment = json.loads((Path(args[0]) / "deployment.json").read_text())
        for name, place in deployment["nodes"].items():
            device = place.get("device", "?") or "GPUs of its own"
            gpus = ",".join(map(str, place.get("gpus") or [])) or "-"
            print(
                f"{name:24} node {place['node']} ({place['address']}), {device}, GPU {place.get('gpu') or '-'}, "
                f"GPUs {gpus}"
            )
        for policy, backend in deployment.get("weight_backends", {}).items():
            print(f"weights of {policy}: {backend}")
        return 0
    uuids = machine_gpu_uuids()
    print(f"{socket.gethostname()}: {len(uuids or [])} GPU(s) visible")
    for index, uuid in enumerate(uuids or []):
        print(f"  cuda:{index}  {uuid}")
    return 0


def machine_gpu_uuids(timeout_s: float = 60.0) -> list[str] | None:
    """This machine's GPUs visible to a process started here, by UUID in CUDA order; None when that cannot
    be told (no torch with CUDA). Asked in a child process, so this one never initialises CUDA."""
    code = (
        "import json, torch\n"
        "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
        "print(json.dumps([str(torch.cuda.get_device_properties(i).uuid) for i in range(n)]))"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def describe(places: dict[str, Place]) -> dict[str, dict[str, str]]:
    """deployment.json's `nodes`: process name -> its place as plain strings."""
    return {name: asdict(place) for name, place in places.items()}


if __name__ == "__main__":
    sys.exit(main())
