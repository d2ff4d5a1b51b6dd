"""How a vLLM server starts, without starting vLLM: the bounds of its start (the backend's own, vLLM's
handshake set longer, the router's and the trainer's waits derived from it), and its share of the GPU with
the weight sync's receive buffers counted in it. Fakes record what would reach vLLM."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from mas_async import startup
from mas_async.config import load_config
from mas_async.deployment import Deployment, free_ports
from mas_async.inference.backends import vllm as vllm_backend
from mas_async.inference.backends import vllm_compat
from mas_async.router.hub import Router
from mas_async.runtime.actor import PeerDead
from tests.support.paths import ROOT

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run one at a time (make test)

GiB = 1 << 30


def _args(on_cpu: bool = False, receive: int = 0, gpu: int = 80 * GiB, **overrides: Any) -> dict[str, Any]:
    return vllm_compat.engine_arguments(
        "/m", {"architectures": ["Qwen3ForCausalLM"]}, dtype="bfloat16", max_num_seqs=8, seed=0, on_cpu=on_cpu,
        receive_bytes=receive, gpu_bytes=gpu, overrides=overrides,
    )  # fmt: skip


def test_the_receive_buffers_are_taken_out_of_vllm_s_share_of_the_gpu() -> None:
    assert _args(receive=8 * GiB, gpu_memory_utilization=0.9)["gpu_memory_utilization"] == pytest.approx(0.8)
    default = vllm_compat.DEFAULT_GPU_MEMORY_UTILIZATION
    assert _args(receive=4 * GiB)["gpu_memory_utilization"] == pytest.approx(default - 0.05)
    assert "gpu_memory_utilization" not in _args(on_cpu=True, receive=4 * GiB)  # the CPU's KV space is fixed
    assert "gpu_memory_utilization" not in _args()  # nothing to receive (eval): vLLM's default
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.3 leaves -0.100 of the GPU's 80.0 GiB once the "
                       r"weight sync's receive buffers \(32.00 GiB\) are taken out: raise"):  # fmt: skip
        _args(receive=32 * GiB, gpu_memory_utilization=0.3)


def test_the_backend_counts_one_copy_of_the_model_in_its_dtype(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model
    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def start_engine(model_path: str, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(vllm_compat, "start_engine", start_engine)
    with pytest.raises(Stop):
        vllm_backend.VLLMBackend(model_dir, dtype="bfloat16", engine_args={"gpu_memory_utilization": 0.5})
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(model_dir)).parameters())  # tied: once
    assert seen["receive_bytes"] == 2 * params + 16  # bf16, and the header's room in front of the first bucket
    assert seen["gpu_memory_utilization"] == 0.5


def test_vllm_s_own_start_wait_is_longer_than_the_backend_s_bound() -> None:
    for on_cpu, executor in ((False, None), (True, "uni"), (True, "mp")):
        env = vllm_compat.engine_environment(on_cpu, executor)
        assert int(env["VLLM_ENGINE_READY_TIMEOUT_S"]) > vllm_backend.START_TIMEOUT_S == startup.VLLM_START_TIMEOUT_S
    assert vllm_compat.engine_environment(True, "uni")["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert vllm_compat.engine_environment(True, "mp")["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in vllm_compat.engine_environment(False, None)  # vLLM's default
    assert _args(on_cpu=True)["distributed_executor_backend"] == "uni"
    assert _args(on_cpu=True, distributed_executor_backend="mp")["distributed_executor_backend"] == "mp"
    assert "distributed_executor_backend" not in _args()  # a GPU: vLLM's choice


def test_a_run_with_vllm_servers_waits_for_their_start() -> None:
    hf = load_config(ROOT / "configs/plan_path_tiny.yaml")
    assert startup.startup_bound_s(hf) == hf.cluster.startup_timeout_s
    with_vllm = load_config(ROOT / "configs/plan_path_tiny.yaml", ["policies.vertical.backend=vllm"])
    assert startup.startup_bound_s(with_vllm) == with_vllm.cluster.startup_timeout_s + startup.VLLM_START_TIMEOUT_S


def test_the_router_waits_the_vllm_engine_s_start_bound_beyond_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(startup.BACKEND_START_TIMEOUT_S, "vllm", 0.8)
    overrides = ["cluster.startup_timeout_s=0.4", "cluster.curve=false", "policies.vertical.backend=vllm"]
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", overrides)
    deployment = Deployment(
        f"tcp://127.0.0.1:{free_ports('127.0.0.1', 1)[0]}",
        {"vertical": 1, "horizontal": 2},
        {"vertical": "", "horizontal": ""},
    )
    router = Router(config, deployment, tmp_path)
    began = time.monotonic()
    with pytest.raises(PeerDead, match=r"peers never joined within 1.2s: \[.*\] \(the bound: "
                       r"cluster.startup_timeout_s=0.4s \+ the vllm engine's start bound 0.8s\)"):  # fmt: skip
        router.run()
    assert 1.2 <= time.monotonic() - began < 3.0
