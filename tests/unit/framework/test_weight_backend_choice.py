"""`cluster.weight_backend`: auto picks, per policy, cuda_ipc (trainer and servers on one GPU), nccl
(different GPUs), gloo (CPU); an explicit choice that cannot work is a ConfigError naming the policy.
A pure function of the config's devices (and of whether CUDA exists, for vLLM), so it runs on CPU."""

from __future__ import annotations

import pytest

from mas_async.config import ConfigError, load_config
from mas_async.deployment import Deployment, weight_backend
from mas_async.weights.group import WeightGroupSpec
from tests.support.paths import ROOT

CONFIG = ROOT / "configs" / "plan_path_tiny.yaml"


def _choice(*overrides: str, policy: str = "vertical", cuda: bool = False) -> str:
    return weight_backend(load_config(CONFIG, list(overrides)), policy, cuda_available=cuda)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ((), "gloo"),
        (("policies.vertical.device=cuda",), "cuda_ipc"),
        (("policies.vertical.device=cuda:1",), "cuda_ipc"),
        (("policies.vertical.device=cuda", "policies.vertical.server_device=cuda:0"), "cuda_ipc"),
        (("policies.vertical.device=cuda:0", "policies.vertical.server_device=cuda:1"), "nccl"),
        (("policies.vertical.device=cpu", "policies.vertical.server_device=cuda:0"), "nccl"),
        (("policies.vertical.device=cuda:0", "policies.vertical.server_device=cpu"), "nccl"),
    ],
)
def test_auto_follows_where_trainer_and_servers_run(overrides: tuple[str, ...], expected: str) -> None:
    assert _choice(*overrides) == expected
    assert _choice(*overrides, cuda=True) == expected  # the devices decide, not the machine


def test_auto_for_vllm_which_places_itself_is_nccl_only_where_cuda_exists() -> None:
    assert _choice("policies.vertical.backend=vllm", cuda=True) == "nccl"
    assert _choice("policies.vertical.backend=vllm", cuda=False) == "gloo"


def test_auto_is_per_policy() -> None:
    config = load_config(CONFIG, ["policies.vertical.device=cuda"])
    assert weight_backend(config, "vertical") == "cuda_ipc" and weight_backend(config, "horizontal") == "gloo"
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": 11, "horizontal": 12}, {"vertical": "", "horizontal": ""})
    spec = WeightGroupSpec.of(config, deployment, "vertical")
    assert spec.backend == "cuda_ipc" and spec.port == 11 and spec.world_size == 2
    assert spec.join_args(1)["backend"] == "cuda_ipc"
    assert WeightGroupSpec.of(config, deployment, "horizontal").backend == "gloo"


def test_an_explicit_choice_that_can_work_is_kept() -> None:
    assert _choice("cluster.weight_backend=gloo", "policies.vertical.device=cuda") == "gloo"
    assert _choice("cluster.weight_backend=nccl", cuda=True) == "nccl"
    both_on_gpu = ["policies.vertical.device=cuda", "policies.horizontal.device=cuda:1"]
    assert _choice("cluster.weight_backend=cuda_ipc", *both_on_gpu) == "cuda_ipc"


def test_explicit_cuda_ipc_on_the_cpu_is_refused_naming_the_policy() -> None:
    with pytest.raises(ConfigError, match=r"cuda_ipc .*policy 'vertical' its trainer is on cpu and its servers on cpu"):
        load_config(CONFIG, ["cluster.weight_backend=cuda_ipc"])
    with pytest.raises(ConfigError, match="policy 'horizontal'"):  # every policy must share its GPU
        load_config(CONFIG, ["cluster.weight_backend=cuda_ipc", "policies.vertical.device=cuda"])


def test_explicit_cuda_ipc_across_two_gpus_or_with_vllm_is_refused() -> None:
    on_gpus = ["policies.horizontal.device=cuda", "cluster.weight_backend=cuda_ipc"]
    with pytest.raises(ConfigError, match="trainer is on cuda:0 and its servers on cuda:1"):
        load_config(CONFIG, [*on_gpus, "policies.vertical.device=cuda:0", "policies.vertical.server_device=cuda:1"])
    with pytest.raises(ConfigError, match="vllm servers place themselves"):
        load_config(CONFIG, [*on_gpus, "policies.vertical.backend=vllm"])


def test_explicit_nccl_on_one_gpu_is_refused() -> None:
    with pytest.raises(ConfigError, match="NCCL refuses two ranks on one GPU"):
        load_config(CONFIG, ["cluster.weight_backend=nccl", "policies.vertical.device=cuda"])


def test_the_gpu_demo_config_shares_each_gpu_through_cuda_ipc() -> None:
    config = load_config(ROOT / "configs" / "plan_path_tiny_gpu.yaml")
    assert {weight_backend(config, p) for p in config.policies} == {"cuda_ipc"}


def test_a_bad_server_device_names_the_key() -> None:
    with pytest.raises(ConfigError, match="policies.vertical.server_device"):
        load_config(CONFIG, ["policies.vertical.server_device=gpu1"])
