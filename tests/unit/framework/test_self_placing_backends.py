"""A backend that places itself (vLLM) is never handed a device, and its engine settings come from the config
(`policies.<p>.vllm`, `cluster.gpu_shares`): through `make_backend`, the inference server and `VLLMBackend` down
to `vllm_compat.start_engine`, which is faked here (no vLLM engine starts, no GPU is needed)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from mas_async.api.registry import BACKENDS
from mas_async.config import ConfigError, load_config
from mas_async.deployment import Deployment
from mas_async.inference.backends import vllm_compat
from mas_async.inference.backends.base import make_backend
from mas_async.inference.backends.vllm import VLLMBackend
from mas_async.inference.backends.vllm_args import check_engine_args, engine_args
from tests.support.paths import ROOT

CONFIG = ROOT / "configs" / "plan_path_tiny.yaml"
ON_VLLM = ["policies.vertical.backend=vllm", "policies.vertical.device=cuda"]
RECORDING = f"{__name__}:RecordingVLLM"


class EngineStarted(Exception):
    """Raised by the fake engine start, carrying what it was started with."""

    def __init__(self, model_path: str, kwargs: dict[str, Any]) -> None:
        super().__init__("the engine start was reached")
        self.model_path, self.kwargs = model_path, kwargs


def _fake_start(model_path: str, **kwargs: Any) -> None:
    raise EngineStarted(model_path, kwargs)


class RecordingVLLM:
    """VLLMBackend's constructor signature (no device parameter), recording what it is built with."""

    concurrent = True
    built: dict[str, Any] = {}

    def __init__(self, model_path, *, dtype="float32", max_batch_sequences=512, seed=0, engine_args=None, lora=None):
        RecordingVLLM.built = {"engine_args": engine_args, "lora": lora}

    async def generate(self, requests):  # a coroutine: served as it is, not behind a thread
        return []


def test_the_recording_fake_has_the_real_backend_s_parameters() -> None:
    assert list(inspect.signature(RecordingVLLM).parameters) == list(inspect.signature(VLLMBackend).parameters)


def test_make_backend_never_hands_a_device_to_a_backend_that_places_itself(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(BACKENDS, "vllm", RECORDING)
    for device in ("cuda", "cuda:1", None):
        make_backend("vllm", str(tmp_path), dtype="bfloat16", max_batch_sequences=4, seed=0, device=device)
    with pytest.raises(ValueError, match="'mock' takes no device"):  # a backend that does not place itself
        make_backend("mock", str(tmp_path), dtype="float32", max_batch_sequences=4, seed=0, device="cuda")


def test_make_backend_passes_engine_args_and_refuses_them_to_a_backend_without_the_parameter(
    monkeypatch, tmp_path
) -> None:
    monkeypatch.setitem(BACKENDS, "vllm", RECORDING)
    make_backend("vllm", str(tmp_path), dtype="bfloat16", max_batch_sequences=4, seed=0,
                 engine_args={"max_model_len": 8192})  # fmt: skip
    assert RecordingVLLM.built["engine_args"] == {"max_model_len": 8192}
    with pytest.raises(ValueError, match=r"'mock' takes no engine_args argument, so it cannot start with \['x'\]"):
        make_backend("mock", str(tmp_path), dtype="float32", max_batch_sequences=4, seed=0, engine_args={"x": 1})


def test_engine_args_from_the_config_reach_vllm_s_engine_start(monkeypatch, tiny_model) -> None:
    config = load_config(CONFIG, [
        *ON_VLLM, "policies.vertical.vllm={gpu_memory_utilization: 0.6, max_model_len: 8192, enforce_eager: true, "
        "engine_args: {kv_cache_dtype: fp8, max_num_batched_tokens: 4096}}",
    ])  # fmt: skip
    monkeypatch.setattr(vllm_compat, "start_engine", _fake_start)
    args = engine_args(config, "inference/vertical/0")
    with pytest.raises(EngineStarted) as started:
        make_backend("vllm", str(tiny_model), dtype="bfloat16", max_batch_sequences=16, seed=3, device="cuda",
                     engine_args=args)  # fmt: skip
    started.value.kwargs.pop("receive_bytes", None)  # (the backend's own, for the weight sync's buffers)
    assert started.value.kwargs == {
        "dtype": "bfloat16", "max_num_seqs": 16, "seed": 3, "gpu_memory_utilization": 0.6, "max_model_len": 8192,
        "enforce_eager": True, "kv_cache_dtype": "fp8", "max_num_batched_tokens": 4096,
    }  # fmt: skip


def test_the_inference_server_starts_a_vllm_policy_of_device_cuda_with_its_engine_args_and_no_device(
    monkeypatch, tiny_model
) -> None:
    """The server path: `device: cuda` (what docs/slurm.md advises for trainers) used to reach vLLM as a device
    argument, which it refuses; the config's engine settings never reached it."""
    from mas_async.inference.server import InferenceServer

    config = load_config(CONFIG, [*ON_VLLM, "policies.vertical.vllm.max_model_len=2048",
                                  "cluster.gpu_shares={inference: 0.45}"])  # fmt: skip
    deployment = Deployment("tcp://127.0.0.1:9", {"vertical": 9, "horizontal": 9}, {"vertical": str(tiny_model)})
    monkeypatch.setattr(vllm_compat, "start_engine", _fake_start)
    with pytest.raises(EngineStarted) as started:
        InferenceServer(config, deployment, "vertical", 1)
    assert started.value.model_path == str(tiny_model)
    assert "device" not in started.value.kwargs
    assert started.value.kwargs["max_model_len"] == 2048
    assert started.value.kwargs["gpu_memory_utilization"] == 0.45  # its share of the GPU it shares
    assert started.value.kwargs["seed"] == config.run.seed * 1000 + 1


def test_engine_args_take_the_named_settings_then_the_others() -> None:
    assert engine_args(load_config(CONFIG, ON_VLLM), "inference/vertical/0") == {}  # vLLM's own defaults
    assert engine_args(load_config(CONFIG, ["policies.vertical.vllm.max_model_len=99"]), "inference/vertical/0") == {}
    shares = ["cluster.gpu_shares={inference: 0.3, inference/vertical/1: 0.5}"]
    config = load_config(CONFIG, [*ON_VLLM, "policies.vertical.replicas=2", *shares])
    assert engine_args(config, "inference/vertical/0") == {"gpu_memory_utilization": 0.3}
    assert engine_args(config, "inference/vertical/1") == {"gpu_memory_utilization": 0.5}  # its own entry
    slurm = load_config(CONFIG, [*ON_VLLM, *shares, "cluster.engine=slurm"])
    assert engine_args(slurm, "inference/vertical/0") == {}  # a SLURM step's GPU is its own: no share


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("policies.vertical.vllm.engine_args={model: /x}", r"engine_args.model is set by the backend, from policies"),
        ("policies.vertical.vllm.engine_args={device_ids: [1]}", r"engine_args.device_ids is set by the engine"),
        ("policies.vertical.vllm.engine_args={gpu_memory_utilization: 0.5}",
         r"engine_args.gpu_memory_utilization is set by policies.<p>.vllm.gpu_memory_utilization"),
        ("policies.vertical.vllm.gpu_memory_utilization=1.5", r"policies.vertical.vllm.gpu_memory_utilization"),
        ("policies.vertical.vllm.tensor_parallel_size=0", r"policies.vertical.vllm.tensor_parallel_size"),
        ("policies.vertical.vllm.max_len=10", r"unknown key 'policies.vertical.vllm.max_len'"),
        ("cluster.gpu_shares={router: 0.5}", r"cluster.gpu_shares.router: not a trainer or inference role"),
        ("cluster.gpu_shares={trainer: 0}", r"cluster.gpu_shares.trainer"),
    ],
)  # fmt: skip
def test_mistakes_in_the_engine_settings_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(CONFIG, [*ON_VLLM, override])


def test_settings_a_run_cannot_start_with_are_refused_before_it_starts() -> None:
    names = ["inference/vertical/0"]
    tp = load_config(CONFIG, [*ON_VLLM, "policies.vertical.vllm.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2: a training run's weight sync joins one rank"):
        check_engine_args(tp, names, training=True)
    check_engine_args(tp, names, training=False)  # mas-async eval: no weight sync
    both = load_config(CONFIG, [*ON_VLLM, "policies.vertical.vllm.gpu_memory_utilization=0.9",
                                "cluster.gpu_shares={inference: 0.5}"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"inference/vertical/0 shares its GPU with a share of 0.5 .* but "
                       r"policies.vertical.vllm.gpu_memory_utilization=0.9; drop one"):  # fmt: skip
        check_engine_args(both, names)


def test_an_engine_arg_vllm_does_not_have_is_refused_with_its_name() -> None:
    pytest.importorskip("vllm")
    good = load_config(CONFIG, [*ON_VLLM, "policies.vertical.vllm.engine_args={kv_cache_dtype: fp8}"])
    check_engine_args(good, ["inference/vertical/0"])
    bad = load_config(CONFIG, [*ON_VLLM, "policies.vertical.vllm.engine_args={kv_cache_dtyp: fp8}"])
    with pytest.raises(ConfigError, match=r"policies.vertical.vllm.engine_args.kv_cache_dtyp: vLLM's AsyncEngineArgs "
                       r"has no such field"):  # fmt: skip
        check_engine_args(bad, ["inference/vertical/0"])
