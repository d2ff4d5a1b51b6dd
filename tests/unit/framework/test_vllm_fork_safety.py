"""A vLLM server starts its engine on a GPU: the server process never queries CUDA before vLLM has started its
processes, and vLLM spawns them. No GPU here: a fake stands in for the C layer of a CUDA build of torch and
behaves as torch/csrc/cuda/Module.cpp does (`_cuda_getDeviceCount` poisons fork for the process without
initialising CUDA; a child forked after that fails as soon as it initialises CUDA); torch's own Python code
(`torch.cuda.is_available`, `is_initialized`) and vLLM's own choice of how to start its engine core
(`get_mp_context`, the real function) run on top of it. vLLM's engine start (`AsyncLLM.from_engine_args`) is
replaced by a fake that starts the engine core by the method vLLM chose: a fork inherits the parent's CUDA
state, a spawn starts clean."""

from __future__ import annotations

import json
import sys
import traceback
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm import envs as vllm_envs  # noqa: E402
from vllm import platforms as vllm_platforms  # noqa: E402
from vllm.utils.system_utils import get_mp_context  # noqa: E402

from mas_async.inference.backends import vllm_compat  # noqa: E402


class FakeCudaBuild:
    """The process's CUDA state as a CUDA build of torch keeps it, with one GPU (records who poisoned fork)."""

    def __init__(self, in_bad_fork: bool = False) -> None:
        self.poisoned_by: list[str] = []
        """Where `_cuda_getDeviceCount` was called from (it registers the atfork handler that poisons fork)."""
        self.in_bad_fork = in_bad_fork
        """A child forked after the parent was poisoned (torch's `in_bad_fork`)."""
        self.initialised = False

    def get_device_count(self) -> int:  # torch._C._cuda_getDeviceCount: poison_fork(), then cudaGetDeviceCount
        self.poisoned_by.append("".join(traceback.format_stack(limit=6)[:-1]))
        return 1

    def start_child(self, method: str) -> FakeCudaBuild:
        """The CUDA state of a process started by `method`: a fork keeps the parent's poison, a spawn is new."""
        return FakeCudaBuild(in_bad_fork=method == "fork" and bool(self.poisoned_by or self.initialised))

    def init(self) -> None:
        """What the engine core does first (it loads the model on its GPU): torch's `_lazy_init` refuses a
        process forked after the poisoning with torch's own message."""
        if self.in_bad_fork:
            raise RuntimeError(
                "Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, you must use "
                "the 'spawn' start method"
            )
        self.initialised = True


class FakeCudaPlatform:
    """vLLM's CUDA platform as a CUDA build of vLLM detects it (through NVML: no CUDA call)."""

    device_type = "cuda"

    def is_cpu(self) -> bool:
        return False

    def is_rocm(self) -> bool:
        return False

    def get_device_total_memory(self, device_id: int = 0) -> int:  # (NVML's, as NvmlCudaPlatform reads it)
        return 80 << 30


@pytest.fixture
def cuda_build(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCudaBuild]:
    """This process as a CUDA build of torch and vLLM on a machine with one GPU, while the test runs."""
    fake = FakeCudaBuild()
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", fake.get_device_count, raising=False)
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: 1)  # NVML answers on a GPU machine
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: fake.in_bad_fork)
    monkeypatch.setattr(torch.cuda, "_initialized", False)
    monkeypatch.setattr(vllm_platforms, "_current_platform", FakeCudaPlatform())
    for name in ("PYTORCH_NVML_BASED_CUDA_CHECK", "VLLM_WORKER_MULTIPROC_METHOD"):
        monkeypatch.delenv(name, raising=False)  # (restored after: `get_mp_context` may set the second)
    cached = vllm_envs._is_envs_cache_enabled()  # an in-process engine of an earlier test froze vLLM's env
    if cached:
        vllm_envs.disable_envs_cache()
    yield fake
    if cached:
        vllm_envs.enable_envs_cache()


@pytest.fixture
def engine_core(monkeypatch: pytest.MonkeyPatch, cuda_build: FakeCudaBuild) -> dict[str, Any]:
    """vLLM's engine start replaced: the engine core is started as `CoreEngineProcManager` starts it (by the
    method `get_mp_context()` chooses, called here) and initialises CUDA first."""
    started: dict[str, Any] = {}

    class Engine:
        model_config = types.SimpleNamespace(max_model_len=256)
        errored = False

        def shutdown(self) -> None:
            started["shut down"] = True

    class AsyncLLM:
        @staticmethod
        def from_engine_args(engine_args: types.SimpleNamespace) -> Engine:
            method = get_mp_context().get_start_method()
            started["method"] = method
            cuda_build.start_child(method).init()
            started["args"] = engine_args
            return Engine()

    # (vLLM's own modules are not imported: ~15 s of CPU here, and nothing of theirs runs before the start.)
    monkeypatch.setitem(
        sys.modules, "vllm.engine.arg_utils", types.SimpleNamespace(AsyncEngineArgs=types.SimpleNamespace)
    )
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.async_llm", types.SimpleNamespace(AsyncLLM=AsyncLLM))
    return started


def _model(tmp_path) -> str:
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "head_dim": 16,
    }  # fmt: skip  (head_dim 16: a GPU runs it, vLLM's CPU not)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_the_fake_poisons_fork_as_a_cuda_build_does(cuda_build: FakeCudaBuild) -> None:
    """The fake is faithful where the bug lies: torch's `is_available` poisons fork without initialising CUDA,
    so vLLM's real choice is fork, and the forked engine core fails; a spawned one does not."""
    assert torch.cuda.is_available() and cuda_build.poisoned_by
    assert not torch.cuda.is_initialized()
    assert get_mp_context().get_start_method() == "fork"
    with pytest.raises(RuntimeError, match="Cannot re-initialize CUDA in forked subprocess"):
        cuda_build.start_child("fork").init()
    cuda_build.start_child("spawn").init()


def test_a_vllm_server_starts_its_engine_on_a_gpu(tmp_path, cuda_build, engine_core) -> None:
    """`start_engine` (what every engine's server process runs: local, SLURM and Ray start the same
    `mas_async.launch.process`) on a GPU: the engine core comes up, CUDA was never queried in the server, and
    the engine's processes are spawned."""
    vllm_compat.start_engine(_model(tmp_path), dtype="bfloat16", max_num_seqs=4, seed=0)
    assert engine_core["method"] == "spawn"
    assert cuda_build.poisoned_by == [], "the server process queried CUDA before its engine started:\n" + "\n".join(
        cuda_build.poisoned_by
    )
    assert engine_core["args"].enforce_eager is False  # (the GPU's arguments: compiled, CUDA graphs)


def test_the_engine_environment_spawns_on_a_gpu_and_leaves_the_cpu_s_as_it_was() -> None:
    assert vllm_compat.engine_environment(False, None)["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in vllm_compat.engine_environment(True, "mp")


def test_an_inference_server_starts_its_vllm_engine_without_asking_cuda(tiny_model, cuda_build, engine_core) -> None:
    """The server process's whole start before its engine (the role's seeding, the weight groups' places of a
    deployment built without them, the backend's receive buffers, the engine start): CUDA is never queried."""
    from mas_async import placement
    from mas_async.config import load_config
    from mas_async.deployment import Deployment
    from mas_async.inference.server import InferenceServer
    from mas_async.launch.roles import seed_torch
    from tests.support.paths import ROOT

    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["policies.vertical.backend=vllm"])
    path = str(tiny_model)
    deployment = Deployment(
        "tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 2}, {"vertical": path, "horizontal": path}
    )
    seed_torch(config)
    server = InferenceServer(config, deployment, "vertical", 0)
    try:
        assert engine_core["method"] == "spawn" and server.backend.max_model_len == 256
        assert cuda_build.poisoned_by == [], "the server process queried CUDA before its engine started:\n" + (
            "\n".join(cuda_build.poisoned_by)
        )
        assert placement._cuda_available() and not cuda_build.poisoned_by  # (it sees the GPU, through NVML)
    finally:
        server.backend.close()
    assert engine_core["shut down"]
