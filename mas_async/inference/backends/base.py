"""The interface between an inference server and its backend (hf, vllm, mock).

A backend generates completions for a batch of requests and loads version-tagged weights broadcast by
the policy's trainer. `ThreadedBackend` adapts a synchronous engine (the transformers one, the mock) to
this interface: one batch at a time in a worker thread, weights received by the receiver of the
policy's weight sync (`mas_async.weights.sync`: a broadcast, or CUDA IPC views of the trainer's shared
buffers) and adopted with the engine's `adopt_weights`, or copied with its `load_weights`. The vLLM backend implements the interface
natively (`concurrent = True`: several batches may be in flight; vLLM batches them continuously).
An engine that serves other policies on its base (`guests`) is reached for each of them through
`ThreadedBackend.guest(policy)`: the same engine, that policy's adapters, weight sync and version.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import TYPE_CHECKING, Any, Protocol

from mas_async.api.registry import BACKENDS, resolve
from mas_async.config import SELF_PLACING_BACKENDS
from mas_async.weights.sync import open_receiver, retire_replaced

if TYPE_CHECKING:
    import torch

    from mas_async.inference.request import GenerationRequest
    from mas_async.lora import LoraSetup
    from mas_async.weights.cuda_ipc import CudaIpcReceiver
    from mas_async.weights.receiver import WeightReceiver
    from mas_async.wire.samples import Completion


class InferenceBackend(Protocol):
    version: int
    """Weight version of the loaded weights; stamped on every completion."""
    concurrent: bool
    """True when several generate() calls may run at once (continuous batching)."""

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        """n completions for each request, every one carrying `version`."""
        ...

    def join_weight_group(
        self,
        *,
        policy: str,
        backend: str,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float = 300.0,
        generation: int = 0,
        join_timeout_s: float | None = None,
    ) -> None:
        """Join generation `generation` of the policy's weight-broadcast group (blocking, in a thread; again
        with a newer generation when the group is re-formed); `timeout_s` bounds every broadcast of an update
        (`trainer.weight_sync_timeout_s`), `join_timeout_s` the join (default `timeout_s`; the first
        generation's is the run's startup bound, `WeightGroupSpec.join_args`). Raises `GroupRetired` when the
        trainer gives the generation up before every rank joined."""
        ...

    def update_weights(self, version: int) -> None:
        """Receive every tensor of the broadcast of `version`, then load them and set `version`
        (blocking, in a thread; the server guarantees no generate() runs meanwhile). Raises `GroupRetired`,
        with the weights unchanged, when the group is re-formed meanwhile."""
        ...

    # Optional, for updates that do not stop generation (bounded staleness): `receive_weights(version)`
    # returns the received tensors without touching the weights being served (generate() may run
    # meanwhile), and `apply_weights(version, tensors)` loads them (no generate() runs meanwhile).


class SyncEngine(Protocol):
    version: int

    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]: ...

    def parameter_manifest(self) -> list[tuple[str, list[int], str]] | None: ...

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None: ...

    # Optional: `adopt_weights(named_tensors)`, taking the tensors as its parameters without a copy.
    # An engine built with `guests` also takes `adapter=<guest policy>` in generate, load_weights and
    # adopt_weights, and keeps each guest's version in `guest_versions`.


class ThreadedBackend:
    """A synchronous engine behind the async backend interface: one batch at a time, in a thread."""

    concurrent = False

    def __init__(self, engine: SyncEngine, adapter: str = "") -> None:
        self.engine = engine
        self.adapter = adapter
        """"": the engine's own policy; else the guest policy this backend serves on the engine's base."""
        self._named = {"adapter": adapter} if adapter else {}
        self.receiver: WeightReceiver | CudaIpcReceiver | None = None
        self._live_set = 1
        """The receiver's buffer set the engine's parameters are views of (after an adopt)."""

    def guest(self, policy: str) -> ThreadedBackend:
        """The backend of guest `policy` on this engine's base: its own adapters, weight sync and version
        (batches of different policies must still run one at a time: the server serves them in turn)."""
        if policy not in getattr(self.engine, "guest_versions", {}):
            raise ValueError(f"the engine serves no guest policy {policy!r}")
        return ThreadedBackend(self.engine, adapter=policy)

    @property
    def version(self) -> int:
        return self.engine.guest_versions[self.adapter] if self.adapter else self.engine.version

    @version.setter
    def version(self, value: int) -> None:
        if self.adapter:
            self.engine.guest_versions[self.adapter] = value
        else:
            self.engine.version = value

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        return await asyncio.to_thread(self.engine.generate, requests, **self._named)

    def join_weight_group(
        self,
        *,
        policy: str,
        backend: str,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float = 300.0,
        generation: int = 0,
        join_timeout_s: float | None = None,
    ) -> None:
        """Join the policy's weight sync: a torch.distributed group (gloo, nccl), or, with "cuda_ipc", the
        control channel of the trainer's shared buffers on this same GPU (`mas_async.weights.sync`). A
        re-formed group gets a new receiver with buffers of its own (a receive abandoned in the old one
        may still end in the old buffers); the old one's generation is given up first."""
        retire_replaced(self.receiver)
        self.receiver = open_receiver(
            policy=policy, backend=backend, host=host, port=port, rank=rank, world_size=world_size,
            timeout_s=timeout_s, generation=generation, join_timeout_s=join_timeout_s,
        )  # fmt: skip

    def update_weights(self, version: int) -> None:
        """Receive and load `version`. An engine with `adopt_weights` takes the received buffers as its
        parameters (no copy); the next version then goes into the other of two buffer sets, so the
        weights being served are never written to."""
        self.apply_weights(version, self.receive_weights(version))

    def receive_weights(self, version: int) -> list[tuple[str, torch.Tensor]]:
        """Receive `version` into the buffer set the engine is not serving from (safe while it generates:
        an adopting engine serves the other set, a copying one its own parameters)."""
        assert self.receiver is not None, "join_weight_group() first"
        spare = 1 - self._live_set if hasattr(self.engine, "adopt_weights") else 0
        got, tensors = self.receiver.receive(self.engine.parameter_manifest(), buffer_set=spare)
        if got != version:
            raise ValueError(f"the broadcast carried version {got}, the trainer announced {version}")
        return tensors

    def apply_weights(self, version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Make the received `tensors` the weights served as `version` (no batch runs meanwhile)."""
        adopt = getattr(self.engine, "adopt_weights", None)
        if adopt is not None:
            adopt(tensors, **self._named)
            self._live_set = 1 - self._live_set
        else:
            self.engine.load_weights(tensors, **self._named)
        self.version = version


def make_backend(
    name: str,
    model_path: str,
    *,
    dtype: str,
    max_batch_sequences: int,
    seed: int,
    device: str | None = "cpu",
    lora: LoraSetup | None = None,
    guests: dict[str, LoraSetup] | None = None,
    engine_args: dict[str, Any] | None = None,
) -> InferenceBackend:
    """The backend named in the policy's config (`policies.<name>.backend`): a key of
    `mas_async.api.BACKENDS` or a "module:Class" path. The class is built with `(model_path, dtype=...,
    max_batch_sequences=..., seed=...)`, plus `device=...` when the policy is not on the CPU, `lora=...`
    when it trains LoRA adapters, `guests=...` when other policies share its base (`policies.<p>.base`; reach
    each through `ThreadedBackend.guest`) and `engine_args=...` when the config sets its engine's arguments
    (`policies.<p>.vllm`); a backend without the parameter is then refused. A backend that places itself
    (`SELF_PLACING_BACKENDS`: vLLM) is never handed a device, whatever `device` says (None: none to hand): its
    GPUs are the ones its process sees. A synchronous engine (a `generate` that is not a coroutine function)
    runs behind `ThreadedBackend`, one batch at a time in a thread."""
    cls = resolve(name, BACKENDS, "inference backend")
    parameters = inspect.signature(cls).parameters
    kwargs: dict[str, object] = {}
    # Only off the CPU, so that backends written before the key existed keep working.
    if device is not None and device != "cpu" and name not in SELF_PLACING_BACKENDS:
        if "device" not in parameters:
            raise ValueError(f"inference backend {name!r} takes no device argument, so it cannot run on {device!r}")
        kwargs["device"] = device
    if lora is not None:
        if "lora" not in parameters:
            raise ValueError(f"inference backend {name!r} takes no lora argument, so it cannot serve LoRA adapters")
        kwargs["lora"] = lora
    if guests:
        if "guests" not in parameters:
            raise ValueError(f"inference backend {name!r} takes no guests argument, so it cannot share its base")
        kwargs["guests"] = guests
    if engine_args:
        if "engine_args" not in parameters:
            raise ValueError(
                f"inference backend {name!r} takes no engine_args argument, so it cannot start with {sorted(engine_args)}"
            )
        kwargs["engine_args"] = engine_args
    engine = cls(model_path, dtype=dtype, max_batch_sequences=max_batch_sequences, seed=seed, **kwargs)
    if inspect.iscoroutinefunction(getattr(engine, "generate", None)):
        if guests:
            raise ValueError(f"inference backend {name!r} is asynchronous: its guests cannot be served in turn")
        return engine
    return ThreadedBackend(engine)
