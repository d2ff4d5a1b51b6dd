"""The vLLM engine arguments of each server, from the config: `policies.<p>.vllm` (named settings, and any other
`AsyncEngineArgs` field in `engine_args`) and the server's GPU share (`cluster.gpu_shares`, its
`gpu_memory_utilization`). The inference server passes them to the backend (`make_backend(engine_args=...)`,
`VLLMBackend(engine_args=...)`), which starts vLLM with them over its own defaults
(`vllm_compat.start_engine(**overrides)`); the launcher and the dry run check them first (`check_engine_args`).
A server is never given a device: its GPUs are its own (CUDA_VISIBLE_DEVICES, `mas_async.gpu_plan`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import TYPE_CHECKING, Any

from mas_async.config import SELF_PLACING_BACKENDS, ConfigError
from mas_async.gpu_plan import gpu_share

if TYPE_CHECKING:
    from mas_async.config import Config


def engine_args(config: Config, name: str) -> dict[str, Any]:
    """The engine arguments of vLLM server `name` (inference/P/I), over the backend's defaults: the named
    settings that are set, its GPU share as `gpu_memory_utilization` (local engine) unless that is set, then
    `engine_args`. Empty for a policy whose servers are not vLLM's."""
    policy = name.split("/")[1]
    spec = config.policies[policy]
    if spec.backend not in SELF_PLACING_BACKENDS:
        return {}
    settings = spec.vllm
    args: dict[str, Any] = {}
    share = gpu_share(config, name) if config.cluster.engine == "local" else None
    utilization = settings.gpu_memory_utilization if settings.gpu_memory_utilization is not None else share
    if utilization is not None:
        args["gpu_memory_utilization"] = utilization
    if settings.tensor_parallel_size != 1:
        args["tensor_parallel_size"] = settings.tensor_parallel_size
    if settings.max_model_len is not None:
        args["max_model_len"] = settings.max_model_len
    if settings.enforce_eager is not None:
        args["enforce_eager"] = settings.enforce_eager
    return args | settings.engine_args


def check_engine_args(config: Config, names: list[str], training: bool = True) -> None:
    """Refuse what vLLM servers `names` cannot start with, each in a sentence naming the key: a tensor parallel
    size above 1 in training, a GPU share that disagrees with an explicit `gpu_memory_utilization`, and an
    `engine_args` name that vLLM's `AsyncEngineArgs` does not have (where vLLM is installed here)."""
    for name in names:
        policy = name.split("/")[1]
        spec = config.policies[policy]
        if spec.backend not in SELF_PLACING_BACKENDS:
            continue
        settings = spec.vllm
        if training and settings.tensor_parallel_size > 1:
            raise ConfigError(
                f"policies.{policy}.vllm.tensor_parallel_size={settings.tensor_parallel_size}: a training run's "
                "weight sync joins one rank per vLLM server, not one per tensor-parallel worker; use 1 (Qwen3-1.7B "
                "and -8B fit one GPU) with more policies.<p>.replicas, or evaluate with it (mas-async eval)"
            )
        share = gpu_share(config, name) if config.cluster.engine == "local" else None
        explicit = settings.gpu_memory_utilization
        if share is not None and explicit is not None and abs(share - explicit) > 1e-9:
            raise ConfigError(
                f"{name} shares its GPU with a share of {share:g} (cluster.gpu_shares), which a vLLM server takes "
                f"as its gpu_memory_utilization, but policies.{policy}.vllm.gpu_memory_utilization={explicit:g}; "
                "drop one of the two"
            )
    unknown = unknown_engine_args(
        {key for name in names for key in config.policies[name.split("/")[1]].vllm.engine_args}
    )
    if unknown:
        policy, key = next(
            (name.split("/")[1], key)
            for name in names
            for key in config.policies[name.split("/")[1]].vllm.engine_args
            if key in unknown
        )
        raise ConfigError(
            f"policies.{policy}.vllm.engine_args.{key}: vLLM's AsyncEngineArgs has no such field (vLLM "
            f"{_vllm_version()}); see `vllm serve --help` for the names"
        )


def unknown_engine_args(names: set[str]) -> set[str]:
    """The names among `names` that vLLM's `AsyncEngineArgs` lacks; empty where vLLM is not installed here (the
    server's start refuses them there) or no names are given (vLLM is not imported then: seconds)."""
    if not names or importlib.util.find_spec("vllm") is None:
        return set()
    from vllm.engine.arg_utils import AsyncEngineArgs

    return names - {field.name for field in dataclasses.fields(AsyncEngineArgs)}


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)
