"""`cluster.weight_backend`: the deployment decides it per policy from where the engine placed the processes
(`mas_async.placement`): gloo when any of the trainer and its servers is on the CPU (NCCL and CUDA IPC join GPUs
only), cuda_ipc when they all use one GPU, nccl across GPUs and nodes; an explicit choice the placement cannot
carry is a ConfigError naming the policy. The
facts are given by hand here (node names, GPU views and UUIDs, as engines report them), so every case runs
on the CPU; `prepare_deployment` records them in deployment.json through a fake engine."""

from __future__ import annotations

import json

import pytest

from mas_async.config import ConfigError, load_config
from mas_async.deployment import Deployment
from mas_async.gpu_plan import plan_gpus
from mas_async.launch.engines.base import Engine, Node, ProcessSpec
from mas_async.launch.engines.slurm import SlurmEngine
from mas_async.launch.launcher import place_specs, prepare_deployment, process_specs
from mas_async.placement import Place, one_machine, place_processes, weight_backend, weight_backend_choice
from mas_async.placement import main as placement_main
from mas_async.weights.group import WeightGroupSpec
from tests.support.paths import ROOT

CONFIG = ROOT / "configs" / "plan_path_tiny.yaml"
SLURM_GPU = ["cluster.engine=slurm", "policies.vertical.device=cuda", "policies.horizontal.device=cuda"]
PROCESSES = ["router", "trainer/vertical", "inference/vertical/0", "trainer/horizontal", "inference/horizontal/0"]


def _choice(*overrides: str, policy: str = "vertical", cuda: bool = False) -> str:
    config = load_config(CONFIG, list(overrides))
    return weight_backend(config, policy, one_machine(config), cuda_available=lambda: cuda)


def _placed(config, nodes: dict[str, str], uuids: dict[str, list[str]] | None = None) -> dict[str, Place]:
    """Places on the named nodes (process -> node, unnamed: node0); each node's processes number its GPUs."""
    where = {name: (nodes.get(name, "node0"), "10.0.0.1") for name in one_machine(config)}
    return place_processes(config, where, lambda name: where[name][0], lambda view: (uuids or {}).get(view))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ((), "gloo"),
        (("policies.vertical.device=cuda",), "cuda_ipc"),
        (("policies.vertical.device=cuda:1",), "cuda_ipc"),
        (("policies.vertical.device=cuda", "policies.vertical.server_device=cuda:0"), "cuda_ipc"),
        (("policies.vertical.device=cuda:0", "policies.vertical.server_device=cuda:1"), "nccl"),
        # any member on the CPU: NCCL joins GPUs only (the trainer, or a server)
        (("policies.vertical.device=cpu", "policies.vertical.server_device=cuda:0"), "gloo"),
        (("policies.vertical.device=cuda:0", "policies.vertical.server_device=cpu"), "gloo"),
        (("policies.vertical.device=cuda:0", "policies.vertical.server_device=cuda:1", "policies.vertical.replicas=2",
          "cluster.weight_backend=auto"), "gloo"),
        # two replicas on one GPU that is not the trainer's: NCCL cannot join them, CUDA IPC does not apply
        (("policies.vertical.device=cuda:0", "policies.vertical.server_device=cuda:1", "policies.vertical.replicas=2"),
         "gloo"),
        (("policies.vertical.device=cuda:0", "policies.vertical.replicas=2"), "cuda_ipc"),  # all on one GPU
    ],
)  # fmt: skip
def test_auto_on_one_machine_follows_the_devices(overrides: tuple[str, ...], expected: str) -> None:
    assert _choice(*overrides) == expected
    assert _choice(*overrides, cuda=True) == expected  # the places decide, not the machine


def test_auto_for_vllm_which_places_itself_is_nccl_only_where_cuda_exists_and_the_trainer_is_on_a_gpu() -> None:
    """Servers whose GPUs nobody planned (a deployment no engine placed): NCCL where CUDA exists, and only with
    the trainer on a GPU too; a trainer on the CPU (the Qwen configs' old default) means gloo."""
    on_gpu = ("policies.vertical.backend=vllm", "policies.vertical.device=cuda")
    assert _choice(*on_gpu, cuda=True) == "nccl"
    assert _choice(*on_gpu, cuda=False) == "gloo"
    assert _choice("policies.vertical.backend=vllm", cuda=True) == "gloo"  # the trainer is on the CPU
    config = load_config(CONFIG, ["policies.vertical.backend=vllm"])
    assert weight_backend_choice(config, "vertical", one_machine(config), lambda: True) == (
        "gloo", "trainer/vertical is on the CPU (NCCL joins GPUs only)"
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"nccl cannot join policy 'vertical'.*trainer/vertical is on the CPU"):
        weight_backend(load_config(CONFIG, ["policies.vertical.backend=vllm", "cluster.weight_backend=nccl"]),
                       "vertical", one_machine(config), lambda: True)  # fmt: skip


def test_a_planned_vllm_server_on_the_cpu_or_on_the_trainer_s_gpu_is_gloo_whatever_this_machine_has() -> None:
    """Planned places (`gpu_plan`): a vLLM server of a machine without GPUs runs on the CPU; one that shares the
    trainer's GPU (cluster.gpu_shares) cannot take NCCL (one GPU) nor CUDA IPC (vLLM copies the weights in)."""
    config = load_config(CONFIG, ["policies.vertical.backend=vllm", "policies.vertical.device=cuda"])
    cpu_server = _planned(config, gpus=0, vllm_only=True)
    assert cpu_server["inference/vertical/0"].device == "cpu" and cpu_server["inference/vertical/0"].gpus == ()
    slurm = load_config(CONFIG, ["policies.vertical.backend=vllm", "policies.vertical.device=cuda",
                                 "cluster.engine=slurm", "cluster.slurm.gpus={inference: 0}"])  # fmt: skip
    engine = SlurmEngine.planning(slurm, 1)
    _, on_cpu = place_specs(slurm, engine, process_specs(slurm))
    assert on_cpu["inference/vertical/0"].device == "cpu" and on_cpu["trainer/vertical"].gpus == (0,)
    assert weight_backend(slurm, "vertical", on_cpu, lambda: True) == "gloo"
    shared = load_config(CONFIG, ["policies.vertical.backend=vllm", "policies.vertical.device=cuda",
                                  "cluster.gpu_shares={trainer: 0.4, inference: 0.5}"])  # fmt: skip
    places = _planned(shared, gpus=1)
    assert places["trainer/vertical"].gpu == places["inference/vertical/0"].gpu == "m/cuda:0"
    assert weight_backend_choice(shared, "vertical", places, lambda: False) == (
        "gloo", "NCCL refuses two ranks on one GPU (trainer/vertical and inference/vertical/0 on cuda:0 of node m; "
        "vLLM takes no CUDA IPC)"
    )  # fmt: skip
    own = _planned(config, gpus=2)
    assert weight_backend_choice(config, "vertical", own, lambda: False)[0] == "nccl"  # not the machine's CUDA


def _planned(config, gpus: int, vllm_only: bool = False) -> dict[str, Place]:
    """The places of one machine `m` of `gpus` GPUs as the local engine plans them (`gpu_plan.plan_gpus`);
    `vllm_only`: of the inference servers only."""
    names = [n for n in one_machine(config) if n.startswith("inference/") or not vllm_only]
    plan = plan_gpus(config, names, lambda name: "m", lambda pool: gpus)
    return place_processes(config, dict.fromkeys(names, ("m", "127.0.0.1")), lambda name: "m", plan=plan)


def test_slurm_trainer_and_servers_on_two_nodes_sync_over_nccl() -> None:
    """The first real cluster run: both sides say `cuda`, but on two nodes that is two GPUs."""
    config = load_config(CONFIG, SLURM_GPU)
    places = _placed(config, {"inference/vertical/0": "node1", "inference/horizontal/0": "node1"})
    assert places["trainer/vertical"].gpu == "node0/cuda:0" and places["inference/vertical/0"].gpu == "node1/cuda:0"
    assert weight_backend(config, "vertical", places) == "nccl"
    explicit = load_config(CONFIG, [*SLURM_GPU, "cluster.weight_backend=nccl"])  # accepted there
    assert weight_backend(explicit, "vertical", _placed(explicit, {"inference/vertical/0": "node1"})) == "nccl"
    with pytest.raises(ConfigError, match=r"cuda_ipc .*policy 'vertical' its trainer is on cuda:0 of node node0 and "
                       r"its servers on cuda:0 of node node1: one device name, other GPUs"):  # fmt: skip
        weight_backend(
            load_config(CONFIG, [*SLURM_GPU, "cluster.weight_backend=cuda_ipc"]), "vertical",
            _placed(config, {"inference/vertical/0": "node1"}),
        )  # fmt: skip


def test_slurm_trainer_and_servers_on_one_node_and_gpu_share_it_through_cuda_ipc() -> None:
    config = load_config(CONFIG, SLURM_GPU)
    places = _placed(config, {"trainer/vertical": "node1", "inference/vertical/0": "node1"})
    assert weight_backend(config, "vertical", places) == "cuda_ipc"
    with pytest.raises(ConfigError, match=r"nccl cannot join policy 'vertical'.*trainer/vertical and "
                       r"inference/vertical/0 on cuda:0 of node node1"):  # fmt: skip
        weight_backend(load_config(CONFIG, [*SLURM_GPU, "cluster.weight_backend=nccl"]), "vertical", places)


def test_gpu_uuids_decide_where_the_engine_knows_them() -> None:
    """Where the engine can tell the UUIDs, one GPU is one UUID whatever the process calls it."""
    config = load_config(CONFIG, ["policies.vertical.device=cuda:0", "policies.vertical.server_device=cuda:1"])
    two = _placed(config, {}, {"node0": ["GPU-aaaa", "GPU-bbbb"]})
    assert (two["trainer/vertical"].gpu, two["inference/vertical/0"].gpu) == ("GPU-aaaa", "GPU-bbbb")
    assert weight_backend(config, "vertical", two) == "nccl"
    # A view whose two indices are one GPU (e.g. CUDA_VISIBLE_DEVICES naming it twice) shares it.
    same = _placed(config, {}, {"node0": ["GPU-aaaa", "GPU-aaaa"]})
    assert weight_backend(config, "vertical", same) == "cuda_ipc"


def test_a_process_with_its_own_gpu_view_never_shares_by_name() -> None:
    """Ray reserves GPUs per process: each sees its own as cuda:0 (`RayEngine.gpu_view` is the process)."""
    config = load_config(CONFIG, ["policies.vertical.device=cuda", "cluster.engine=ray"])
    where = {name: ("n", "10.0.0.1") for name in one_machine(config)}
    places = place_processes(config, where, lambda name: name)
    assert weight_backend(config, "vertical", places) == "nccl"
    with pytest.raises(ConfigError, match=r"cuda_ipc .*one device name, other GPUs"):
        weight_backend(load_config(CONFIG, ["policies.vertical.device=cuda", "cluster.engine=ray",
                                            "cluster.weight_backend=cuda_ipc"]), "vertical", places)  # fmt: skip


def test_auto_is_per_policy_and_the_spec_takes_the_deployment_s_decision() -> None:
    config = load_config(CONFIG, ["policies.vertical.device=cuda"])
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": 11, "horizontal": 12}, {"vertical": "", "horizontal": ""})
    spec = WeightGroupSpec.of(config, deployment, "vertical")  # no places recorded: one machine
    assert spec.backend == "cuda_ipc" and spec.port == 11 and spec.world_size == 2
    assert spec.join_args(1)["backend"] == "cuda_ipc"
    assert WeightGroupSpec.of(config, deployment, "horizontal").backend == "gloo"
    deployment.weight_backends = {"vertical": "nccl", "horizontal": "gloo"}  # as the launcher decided it
    assert WeightGroupSpec.of(config, deployment, "vertical").backend == "nccl"


def test_an_explicit_choice_that_can_work_is_kept() -> None:
    assert _choice("cluster.weight_backend=gloo", "policies.vertical.device=cuda") == "gloo"
    two_gpus = ["policies.vertical.device=cuda:0", "policies.vertical.server_device=cuda:1"]
    assert _choice("cluster.weight_backend=nccl", *two_gpus) == "nccl"
    with pytest.raises(ConfigError, match=r"nccl cannot join .*trainer/vertical is on the CPU"):
        _choice("cluster.weight_backend=nccl", cuda=True)  # (accepted before: NCCL joins GPUs only)
    both_on_gpu = ["policies.vertical.device=cuda", "policies.horizontal.device=cuda:1"]
    assert _choice("cluster.weight_backend=cuda_ipc", *both_on_gpu) == "cuda_ipc"


def test_explicit_cuda_ipc_on_the_cpu_is_refused_naming_the_policy() -> None:
    with pytest.raises(ConfigError, match=r"cuda_ipc .*policy 'vertical' its trainer is on cpu and its servers on cpu"):
        _choice("cluster.weight_backend=cuda_ipc")
    with pytest.raises(ConfigError, match="policy 'horizontal'"):  # every policy must share its GPU
        _choice("cluster.weight_backend=cuda_ipc", "policies.vertical.device=cuda", policy="horizontal")


def test_explicit_cuda_ipc_across_two_gpus_or_with_vllm_is_refused() -> None:
    with pytest.raises(ConfigError, match="trainer is on cuda:0 of node local and its servers on cuda:1 of node local"):
        _choice(
            "cluster.weight_backend=cuda_ipc",
            "policies.vertical.device=cuda:0",
            "policies.vertical.server_device=cuda:1",
        )
    with pytest.raises(ConfigError, match="its vllm servers take no CUDA IPC"):
        _choice("cluster.weight_backend=cuda_ipc", "policies.vertical.backend=vllm", "policies.vertical.device=cuda")


def test_explicit_nccl_on_one_gpu_is_refused() -> None:
    with pytest.raises(ConfigError, match="NCCL refuses two ranks on one GPU"):
        _choice("cluster.weight_backend=nccl", "policies.vertical.device=cuda")


def test_a_shared_base_on_one_gpu_is_refused_cuda_ipc() -> None:
    lora = "{r: 4, alpha: 8}"
    shared = [f"policies.vertical.lora={lora}", f"policies.horizontal.lora={lora}", "policies.vertical.base=horizontal"]
    on_gpu = ["policies.vertical.device=cuda", "policies.horizontal.device=cuda"]
    with pytest.raises(ConfigError, match=r"policies.vertical.base=horizontal: a shared base .* not CUDA IPC"):
        _choice(*shared, *on_gpu)
    assert _choice(*shared, *on_gpu, "cluster.weight_backend=gloo") == "gloo"


def test_the_gpu_demo_config_shares_each_gpu_through_cuda_ipc() -> None:
    config = load_config(ROOT / "configs" / "plan_path_tiny_gpu.yaml")
    assert {weight_backend(config, p, one_machine(config)) for p in config.policies} == {"cuda_ipc"}


def test_a_bad_server_device_names_the_key() -> None:
    with pytest.raises(ConfigError, match="policies.vertical.server_device"):
        load_config(CONFIG, ["policies.vertical.server_device=gpu1"])


class TwoNodes(Engine):
    """An engine that places the servers on node1 and everything else on node0, and knows node1's GPUs."""

    def place(self, specs: list[ProcessSpec]) -> dict[str, Node]:
        return {
            s.name: Node("node1", "127.0.0.1") if s.role == "inference" else Node("node0", "127.0.0.1") for s in specs
        }

    def free_ports(self, node: Node, count: int) -> list[int]:
        return list(range(30000, 30000 + count))

    def gpu_uuids(self, view: str) -> list[str] | None:
        return ["GPU-n1-0", "GPU-n1-1"] if view == "node1" else None

    def start(self, spec, node, command, env, log_path):  # type: ignore[no-untyped-def]
        raise AssertionError("nothing is started here")


def test_the_launcher_records_every_place_and_the_backends_in_deployment_json(tmp_path, capsys) -> None:
    config = load_config(CONFIG, [*SLURM_GPU, "cluster.curve=false"])
    deployment = prepare_deployment(config, tmp_path, engine=TwoNodes())
    saved = json.loads((tmp_path / "deployment.json").read_text())
    assert saved["weight_backends"] == {"vertical": "nccl", "horizontal": "nccl"} == deployment.weight_backends
    assert saved["nodes"]["trainer/vertical"] == {"node": "node0", "address": "127.0.0.1", "device": "cuda:0",
                                                  "gpu": "node0/cuda:0", "gpus": [0], "cuda_visible_devices": "",
                                                  "share": None}  # fmt: skip
    assert saved["nodes"]["inference/vertical/0"]["gpu"] == "GPU-n1-0"
    assert saved["nodes"]["env_worker/0"] == {"node": "node0", "address": "127.0.0.1", "device": "cpu", "gpu": "",
                                              "gpus": [], "cuda_visible_devices": "", "share": None}  # fmt: skip
    assert Deployment.load(tmp_path / "deployment.json").weight_backend(config, "vertical") == "nccl"
    with pytest.raises(ConfigError, match="cluster.weight_backend=cuda_ipc"):  # refused before anything starts
        prepare_deployment(load_config(CONFIG, [*SLURM_GPU, "cluster.weight_backend=cuda_ipc"]), tmp_path,
                           engine=TwoNodes())  # fmt: skip
    placement_main([str(tmp_path)])  # `python -m mas_async.placement RUN_DIR`, what gpu_check reads too
    printed = capsys.readouterr().out
    assert "inference/vertical/0     node node1 (127.0.0.1), cuda:0, GPU GPU-n1-0" in printed
    assert "weights of vertical: nccl" in printed
