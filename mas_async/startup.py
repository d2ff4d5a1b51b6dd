"""How long the processes of a run may take to start: the router's wait for every peer's Hello, and a
trainer's wait for its servers in the first generation of its weight group.

`cluster.startup_timeout_s` bounds a process's own start (interpreter, imports, a model loaded with
transformers). An inference backend whose engine takes longer than that to start has a bound of its own
(`BACKEND_START_TIMEOUT_S`), which the backend itself waits for its engine, and which is added to
`cluster.startup_timeout_s` wherever a process waits for that backend's servers (`startup_bound_s`): so a
slow engine start is the backend's named error (`EngineTimeout`), never the router's "peers never joined"
or the trainer's weight group giving up first. vLLM's bound covers a cold start on a GPU: import, weights,
torch.compile of the model (minutes with the few CPUs a step holds) and CUDA-graph capture.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mas_async.config import Config

VLLM_START_TIMEOUT_S = 900.0
"""Bound of starting a vLLM engine (`VLLMBackend`): on a CPU it takes about a minute, a cold start of a
1.7B model on a GPU a few (compile and CUDA graphs included), a large model with several GPUs more."""

BACKEND_START_TIMEOUT_S: dict[str, float] = {"vllm": VLLM_START_TIMEOUT_S}
"""Inference backend (its key in `mas_async.api.BACKENDS`) -> the bound of its engine's start, for the
backends slower to start than any process; the others (hf, mock, a "module:Class" path) add nothing, so a
slow backend of one's own needs a larger `cluster.startup_timeout_s`."""


def backend_start_timeout_s(backend: str) -> float:
    """The start bound of `backend`'s engine beyond a process's own start (0 for most backends)."""
    return BACKEND_START_TIMEOUT_S.get(backend, 0.0)


def startup_bound_s(config: Config) -> float:
    """How long the router waits for every process to say Hello, and a trainer for its servers to join the
    first generation of its weight group: `cluster.startup_timeout_s` plus the longest start bound of the
    backends that serve the run's policies (vLLM: 300 + 900 s by default)."""
    slowest = max((backend_start_timeout_s(spec.backend) for spec in config.policies.values()), default=0.0)
    return config.cluster.startup_timeout_s + slowest


def startup_bound_reason(config: Config) -> str:
    """How `startup_bound_s` was reached, for an error message."""
    own = f"cluster.startup_timeout_s={config.cluster.startup_timeout_s:g}s"
    slow = {spec.backend for spec in config.policies.values() if backend_start_timeout_s(spec.backend)}
    if not slow:
        return own
    slowest = max(slow, key=backend_start_timeout_s)
    return f"{own} + the {slowest} engine's start bound {backend_start_timeout_s(slowest):g}s"
