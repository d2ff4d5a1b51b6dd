"""The inference server: serves one policy with a backend and loads version-tagged weights.

Requests queue as they arrive; a batching task takes everything queued and runs it as one batch
(dynamic batching) in a thread, so the event loop keeps answering heartbeats. Every completion carries
the `weight_version` of the weights that produced it. A weight update (UpdateWeights from the policy's
trainer) takes the same lock as a batch: it waits for the batch in progress, receives every tensor of the
broadcast, loads them, bumps the version and acknowledges WeightsLoaded; requests that arrive meanwhile
wait in the queue, so no request is ever served by a mix of two versions. A request past its deadline is
answered with an error instead of being generated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from mas_async.config import Config
from mas_async.deployment import Deployment, weight_backend
from mas_async.messages import (
    Generate,
    GenerateResult,
    Message,
    UpdateWeights,
    WeightsLoaded,
    completion_to_wire,
)
from mas_async.runtime import Peer
from mas_async.weight_sync import WeightReceiver, open_weight_group

if TYPE_CHECKING:
    from mas_async.inference.hf_backend import HFBackend

log = logging.getLogger("mas_async.inference")


def make_backend(name: str, model_path: str, dtype: str, max_batch_sequences: int, seed: int) -> HFBackend:
    if name == "hf":
        from mas_async.inference.hf_backend import HFBackend

        return HFBackend(model_path, dtype=dtype, max_batch_sequences=max_batch_sequences, seed=seed)
    raise ValueError(f"inference backend {name!r} is not available yet (known: hf)")


class InferenceServer(Peer):
    role = "inference"

    def __init__(self, config: Config, deployment: Deployment, policy: str, replica: int) -> None:
        spec = config.policies[policy]
        cluster = config.cluster
        super().__init__(
            f"inference/{policy}/{replica}",
            deployment.router_endpoint,
            policy=policy,
            capacity=spec.max_batch_sequences,
            heartbeat_s=cluster.heartbeat_s,
            peer_timeout_s=cluster.peer_timeout_s,
            startup_timeout_s=cluster.startup_timeout_s,
        )
        self.cfg = config
        self.deployment = deployment
        self.replica = replica
        self.world_size = 1 + spec.replicas
        self.backend = make_backend(
            spec.backend, deployment.model_paths[policy], spec.dtype, spec.max_batch_sequences,
            seed=config.run.seed * 1000 + replica,
        )  # fmt: skip
        self._queue: list[Generate] = []
        self._wakeup = asyncio.Event()
        self._lock = asyncio.Lock()
        self.receiver: WeightReceiver | None = None
        self.served = 0

    async def main(self) -> None:
        group = await asyncio.to_thread(
            open_weight_group,
            policy=self.policy,
            backend=weight_backend(self.cfg),
            host=self.deployment.host,
            port=self.deployment.weight_ports[self.policy],
            rank=1 + self.replica,
            world_size=self.world_size,
        )
        self.receiver = WeightReceiver(group)
        log.info("weight group of %s joined as rank %d", self.policy, 1 + self.replica)
        await self._batch_loop()

    async def on_message(self, msg: Message) -> None:
        if isinstance(msg, Generate):
            self._queue.append(msg)
            self._wakeup.set()
        elif isinstance(msg, UpdateWeights):
            self.spawn(self._update(msg.version), f"update-v{msg.version}")
        else:
            log.warning("unexpected %s", type(msg).__name__)

    async def _batch_loop(self) -> None:
        from mas_async.inference.hf_backend import GenerationRequest

        while not self.stopping.is_set():
            await self._wakeup.wait()
            async with self._lock:
                self._wakeup.clear()
                batch, self._queue = self._queue, []
                now = time.time()
                live = []
                for req in batch:
                    if req.deadline < now:
                        self.send(
                            GenerateResult(
                                req.request_id, req.origin, "deadline passed before generation", []
                            )
                        )
                    else:
                        live.append(req)
                if not live:
                    continue
                requests = [
                    GenerationRequest(
                        prompt_ids=r.prompt_ids,
                        n=r.n,
                        max_tokens=r.max_tokens,
                        temperature=r.temperature,
                        top_p=r.top_p,
                        greedy=r.greedy,
                        stop_token_ids=list(r.stop_token_ids),
                    )  # fmt: skip
                    for r in live
                ]
                results = await asyncio.to_thread(self.backend.generate, requests)
            for req, completions in zip(live, results, strict=True):
                wire = [completion_to_wire(c) for c in completions]
                self.send(GenerateResult(req.request_id, req.origin, "", wire))
            self.served += len(live)

    async def _update(self, version: int) -> None:
        assert self.receiver is not None
        async with self._lock:
            t0 = time.monotonic()
            error = ""
            try:
                got_version, tensors = await asyncio.to_thread(
                    self.receiver.receive, self.backend.parameter_manifest()
                )
                if got_version != version:
                    raise ValueError(f"broadcast carried version {got_version}, announced {version}")
                await asyncio.to_thread(self.backend.load_weights, tensors)
                self.backend.version = version
            except ValueError as e:  # manifest mismatch or bad version: reported, the run stops
                error = str(e)
            log.info(
                "weights v%d loaded in %.3fs%s",
                version,
                time.monotonic() - t0,
                f" ({error})" if error else "",
            )
            self.send(WeightsLoaded(self.policy, version, self.peer_id, error))
