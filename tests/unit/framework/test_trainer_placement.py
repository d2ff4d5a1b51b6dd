"""Where each trainer rank of a policy runs (`policies.<p>.trainer_devices`, `Config.trainer_device`), the
refusals of placements NCCL cannot join, a process placed on a GPU it does not see, and the weight backend
where Ray gives every process GPUs of its own. Pure functions of the config and of placement facts given by
hand (and a real TCPStore for the ranks' GPU check), so they run on the CPU; NCCL itself needs GPUs
(bench/gpu_check.py's ranks rows)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bench.trainer_scaling import spawn_bounded
from mas_async.config import ConfigError, load_config
from mas_async.deployment import Deployment, free_ports
from mas_async.devices import DeviceError, shared_gpus, use_device
from mas_async.placement import one_machine, place_processes, weight_backend
from mas_async.training import data_parallel
from mas_async.training.data_parallel import RankGroupError
from tests.support.paths import ROOT

CONFIG = ROOT / "configs" / "plan_path_tiny.yaml"
RAY_OWN_GPUS = ["cluster.engine=ray", "cluster.ray.trainer_gpus=1"]


def _devices(*overrides: str, ranks: int) -> list[str]:
    config = load_config(CONFIG, [f"policies.vertical.trainer_ranks={ranks}", *overrides])
    return [config.trainer_device("vertical", r) for r in range(ranks)]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ((), ["cpu", "cpu"]),
        (("policies.vertical.device=cuda",), ["cuda:0", "cuda:0"]),  # each its own GPU (CUDA_VISIBLE_DEVICES)
        (("policies.vertical.device=cuda:2",), ["cuda:2", "cuda:3"]),
        (("policies.vertical.trainer_devices=[cuda:3, cuda:1]",), ["cuda:3", "cuda:1"]),
        (("policies.vertical.device=cuda", *RAY_OWN_GPUS), ["cuda:0", "cuda:0"]),  # each sees its own GPU
        (("policies.vertical.device=cuda", "cluster.engine=ray"), ["cuda:0", "cuda:0"]),  # reserved by default
        (
            ("policies.vertical.device=cuda", "cluster.engine=ray", "cluster.ray.trainer_gpus=0"),
            ["cuda:0", "cuda:1"],
        ),  # no GPUs reserved: the node's numbering
        (("policies.vertical.trainer_devices=[cuda, cuda]", "cluster.engine=slurm"), ["cuda:0", "cuda:0"]),
    ],
)
def test_each_rank_has_its_device(overrides: tuple[str, ...], expected: list[str]) -> None:
    assert _devices(*overrides, ranks=2) == expected


def test_rank_0_is_the_trainer_the_weight_backend_sees() -> None:
    config = load_config(
        CONFIG, ["policies.vertical.trainer_ranks=2", "policies.vertical.trainer_devices=[cuda:1, cuda:0]",
                 "policies.vertical.server_device=cuda:1"],
    )  # fmt: skip
    assert config.policies["vertical"].trainer_on() == "cuda:1"
    assert (
        weight_backend(config, "vertical", one_machine(config)) == "cuda_ipc"
    )  # rank 0 shares cuda:1 with the servers


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("policies.vertical.trainer_devices=[cuda:0]",), r"names 1 devices for trainer_ranks=2; give one per rank"),
        (("policies.vertical.trainer_devices=[cpu, cuda:0]",), r"all on the CPU \(gloo\) or all on GPUs"),
        (("policies.vertical.trainer_devices=[cuda:1, cuda:1]",), r"two share a GPU of this machine"),
        (("policies.vertical.trainer_devices=[cuda:0, gpu1]",), r"trainer_devices.1"),
    ],
)
def test_placements_that_cannot_work_are_refused(overrides: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _devices(*overrides, ranks=2)


def test_one_gpu_named_twice_is_left_to_engines_that_give_each_process_its_own() -> None:
    assert _devices("policies.vertical.trainer_devices=[cuda, cuda]", *RAY_OWN_GPUS, ranks=2) == ["cuda:0"] * 2


def test_under_ray_gpus_the_same_name_is_not_one_gpu() -> None:
    """Ray sets each process's CUDA_VISIBLE_DEVICES: trainer and servers both see theirs as cuda:0. The Ray
    engine says so (`RayEngine.gpu_view`: a process that reserves GPUs has a view of its own), and the
    deployment decides from that (`mas_async.placement`)."""
    from mas_async.launch.engines.base import Node, ProcessSpec
    from mas_async.launch.engines.ray import RayEngine

    def ray_places(config):
        engine = object.__new__(RayEngine)  # its placement facts only: no Ray cluster is joined
        engine.config, engine.ray_config = config, config.cluster.ray
        roles = {name: name.split("/")[0] for name in one_machine(config)}
        return place_processes(
            config, {name: ("n", "10.0.0.1") for name in roles},
            lambda name: engine.gpu_view(ProcessSpec(name, roles[name], ()), Node("n", "10.0.0.1")),
        )  # fmt: skip

    on_gpu = ["policies.vertical.device=cuda"]
    one = load_config(CONFIG, on_gpu)
    assert weight_backend(one, "vertical", one_machine(one)) == "cuda_ipc"
    own = load_config(CONFIG, [*on_gpu, *RAY_OWN_GPUS, "cluster.ray.inference_gpus=1"])
    assert weight_backend(own, "vertical", ray_places(own)) == "nccl"
    no_gpus = ["cluster.engine=ray", "cluster.ray.trainer_gpus=0", "cluster.ray.inference_gpus=0"]
    shared = load_config(CONFIG, [*on_gpu, *no_gpus])  # no GPUs reserved: the node's numbering
    assert weight_backend(shared, "vertical", ray_places(shared)) == "cuda_ipc"
    explicit = load_config(CONFIG, [*on_gpu, *RAY_OWN_GPUS, "cluster.weight_backend=cuda_ipc"])
    with pytest.raises(ConfigError, match=r"cuda_ipc .*one device name, other GPUs"):
        weight_backend(explicit, "vertical", ray_places(explicit))
    nccl = load_config(CONFIG, [*on_gpu, *RAY_OWN_GPUS, "cluster.weight_backend=nccl"])
    assert weight_backend(nccl, "vertical", ray_places(nccl)) == "nccl"
    with pytest.raises(ConfigError, match=r"nccl cannot join policy 'vertical'"):
        weight_backend(load_config(CONFIG, [*on_gpu, "cluster.weight_backend=nccl"]), "vertical", one_machine(one))


def test_a_process_placed_on_a_gpu_it_does_not_see_is_told_so() -> None:
    assert use_device("cpu", "x").type == "cpu"
    with pytest.raises(
        DeviceError, match=r"trainer rank 1 of policy 'v' is placed on cuda:3, but this process sees 0 GPU"
    ):
        use_device("cuda:3", "trainer rank 1 of policy 'v'")


def test_a_trainer_rank_on_a_gpu_it_does_not_see_stops_before_loading_anything() -> None:
    from mas_async.training.trainer import Trainer

    config = load_config(CONFIG, ["policies.vertical.trainer_devices=[cuda:0]"])
    deployment = Deployment("tcp://127.0.0.1:9", {"vertical": 9, "horizontal": 9}, {"vertical": "/nowhere"})
    with pytest.raises(DeviceError, match=r"trainer rank 0 of policy 'vertical' is placed on cuda:0"):
        Trainer(config, deployment, "vertical", ROOT)


def test_an_inference_server_on_a_gpu_it_does_not_see_stops_before_loading_anything() -> None:
    from mas_async.inference.server import InferenceServer

    config = load_config(CONFIG, ["policies.vertical.server_device=cuda:1"])
    deployment = Deployment("tcp://127.0.0.1:9", {"vertical": 9, "horizontal": 9}, {"vertical": "/nowhere"})
    with pytest.raises(DeviceError, match=r"inference server vertical/0 is placed on cuda:1"):
        InferenceServer(config, deployment, "vertical", 0)


def test_shared_gpus_pairs_the_ranks_on_one_gpu() -> None:
    assert shared_gpus(["", "", ""]) == []
    assert shared_gpus(["GPU-a", "GPU-b"]) == []
    assert shared_gpus(["GPU-a", "GPU-b", "GPU-a", "GPU-a"]) == [(0, 2), (0, 3)]


def test_ranks_on_one_gpu_are_refused_through_their_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """What every rank does before NCCL starts: says its GPU on the group's store, reads the others'."""
    monkeypatch.setattr(data_parallel, "gpu_id", lambda device: "GPU-1234")
    store = dist.HashStore()
    store.set("1", "GPU-1234 cuda:0 on node-b")
    with pytest.raises(
        RankGroupError, match=r"ranks 0 \(cuda:1 on .*\) and 1 \(cuda:0 on node-b\) of policy 'v' are on one GPU"
    ):
        data_parallel._refuse_shared_gpus(store, "v", 0, 2, "cuda:1")
    store = dist.HashStore()
    store.set("1", "GPU-other cuda:1 on node-b")
    data_parallel._refuse_shared_gpus(store, "v", 0, 2, "cuda:0")  # distinct GPUs: no error


def _join_rank(rank: int, devices: list[str], port: int, out: dict) -> None:
    """A trainer rank in its own process: make its GPU current, join the policy's group, sum its rank."""
    from mas_async.training.data_parallel import DataParallel

    device = use_device(devices[rank], f"rank {rank}")
    try:
        dp = DataParallel.join(policy="v", device=devices[rank], host="127.0.0.1", port=port, rank=rank,
                               world_size=len(devices), timeout_s=60)  # fmt: skip
    except RankGroupError as e:
        out[rank] = str(e)
        return
    out[rank] = dp.sum([float(rank + 1)], device)
    dp.close()


def _ranks(devices: list[str]) -> dict[int, object]:
    import torch.multiprocessing as mp

    out = mp.Manager().dict()
    spawn_bounded(_join_rank, (devices, free_ports("127.0.0.1", 1)[0], out), len(devices), 120, f"ranks on {devices}")
    return dict(out)


def test_two_ranks_on_the_cpu_meet_over_gloo() -> None:
    """The same processes as the GPU cases below, on the CPU."""
    assert _ranks(["cpu", "cpu"]) == {0: [3.0], 1: [3.0]}


@pytest.mark.gpu
def test_two_ranks_on_one_gpu_are_refused_before_nccl_starts() -> None:
    """Both processes see the GPU as cuda:0 (as on two nodes, or under per-process CUDA_VISIBLE_DEVICES)."""
    out = _ranks(["cuda:0", "cuda:0"])
    assert all("are on one GPU" in str(out[r]) for r in (0, 1)), out


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ranks_on_two_gpus_meet_over_nccl() -> None:
    assert _ranks(["cuda:0", "cuda:1"]) == {0: [3.0], 1: [3.0]}
