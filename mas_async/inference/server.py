"""The inference server: serves one policy with a backend and loads version-tagged weights.

Requests queue as they arrive; the batching task takes everything queued and hands it to the backend
as one batch (dynamic batching; a backend with continuous batching, like vLLM, may have several batches
in flight). A backend that runs one batch at a time first waits for the rest of the wave of requests
the episodes are sending (`WaveGather`). Every completion carries the `weight_version` of the weights
that produced it.

A weight update (UpdateWeights from the policy's trainer) goes through `UpdateGate`: it waits until the
batches in flight are done and holds back new ones, receives every tensor of the broadcast, loads them,
bumps the version, acknowledges WeightsLoaded, and only then lets queued requests through. So no request
is ever served by a mix of two versions. A request past its deadline is answered with an error instead
of being generated.
"""

from __future__ import annotations

import asyncio
import logging
import time

from mas_async.config import Config
from mas_async.deployment import Deployment, weight_backend
from mas_async.inference.backend import make_backend
from mas_async.inference.hf_backend import GenerationRequest
from mas_async.messages import Generate, GenerateResult, Message, UpdateWeights, WeightsLoaded, completion_to_wire
from mas_async.runtime import Peer

log = logging.getLogger("mas_async.inference")


class UpdateGate:
    """A writer-preferring reader/writer gate: generation batches are readers, a weight update is the
    writer. The update waits for the batches in flight; batches that arrive meanwhile wait for it."""

    def __init__(self) -> None:
        self._readers = 0
        self._writing = False
        self._cond = asyncio.Condition()

    async def acquire_read(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing)
            self._readers += 1

    async def release_read(self) -> None:
        async with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    async def acquire_write(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing)
            self._writing = True
            await self._cond.wait_for(lambda: self._readers == 0)

    async def release_write(self) -> None:
        async with self._cond:
            self._writing = False
            self._cond.notify_all()


class WaveGather:
    """When a server that runs one batch at a time (hf, mock) takes its queue as the next batch.

    Episodes answer a batch together and send their next prompts together: a wave. A request that
    misses the batch of its wave waits a whole batch, so the server waits while requests keep arriving
    less than `gap_s` apart, never beyond `capacity` sequences. The wave that follows a batch is
    expected to hold as many requests as that batch did; until it does, the allowed gap grows to
    `fraction` of that batch's duration (waiting then costs at most that fraction of a batch). The
    whole wait is never longer than the last batch took, or 20 short gaps before there was one.
    """

    def __init__(self, gap_s: float, fraction: float, capacity: int) -> None:
        self.gap_s = gap_s
        self.fraction = fraction
        self.capacity = capacity
        self.last_requests = 0
        self.last_seconds = 0.0
        self._arrived = asyncio.Event()

    def arrived(self) -> None:
        """A request was queued."""
        self._arrived.set()

    def batch_done(self, requests: int, seconds: float) -> None:
        self.last_requests, self.last_seconds = requests, seconds

    async def wait(self, queue: list[Generate]) -> None:
        """Return when `queue` should be taken as a batch."""
        loop = asyncio.get_running_loop()
        start = last_arrival = loop.time()
        long_gap = max(self.gap_s, self.fraction * self.last_seconds)
        give_up = start + max(self.last_seconds, 20 * self.gap_s)
        seen = len(queue)
        while sum(r.n for r in queue) < self.capacity:
            now = loop.time()
            if len(queue) != seen:
                seen, last_arrival = len(queue), now
            gap = long_gap if seen < self.last_requests else self.gap_s
            wait = min(last_arrival + gap, give_up) - now
            if wait <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), wait)
            except TimeoutError:
                pass


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
            spec.backend,
            deployment.weights_path(policy),
            dtype=spec.dtype,
            max_batch_sequences=spec.max_batch_sequences,
            seed=config.run.seed * 1000 + replica,
        )
        self.backend.version = deployment.start_version
        self._queue: list[Generate] = []
        self._wakeup = asyncio.Event()
        self.gather = WaveGather(spec.batch_gather_ms / 1000, spec.batch_gather_fraction, spec.max_batch_sequences)
        self.gate = UpdateGate()
        self.served = 0

    async def main(self) -> None:
        if not self.deployment.training:  # mas-async eval: fixed weights, no trainer to listen to
            await self._batch_loop()
            return
        await asyncio.to_thread(
            self.backend.join_weight_group,
            policy=self.policy,
            backend=weight_backend(self.cfg),
            host=self.deployment.host,
            port=self.deployment.weight_ports[self.policy],
            rank=1 + self.replica,
            world_size=self.world_size,
        )
        log.info("weight group of %s joined as rank %d", self.policy, 1 + self.replica)
        await self._batch_loop()

    async def on_message(self, msg: Message) -> None:
        if isinstance(msg, Generate):
            self._queue.append(msg)
            self._wakeup.set()
            self.gather.arrived()
        elif isinstance(msg, UpdateWeights):
            self.spawn(self._update(msg.version), f"update-v{msg.version}")
        else:
            log.warning("unexpected %s", type(msg).__name__)

    async def _batch_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            await self.gate.acquire_read()  # waits while a weight update is pending or running
            if not self.backend.concurrent and self.gather.gap_s > 0:
                await self.gather.wait(self._queue)
            self._wakeup.clear()
            batch, self._queue = self._queue, []
            if self.backend.concurrent:
                self.spawn(self._serve(batch), "batch")
            else:
                await self._serve(batch)

    async def _serve(self, batch: list[Generate]) -> None:
        """Generate one batch (the gate's read side is held by the caller and released here)."""
        try:
            now = time.time()
            live = []
            for req in batch:
                if req.deadline < now:
                    self.send(GenerateResult(req.request_id, req.origin, "deadline passed before generation", []))
                else:
                    live.append(req)
            if not live:
                return
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
            started = time.monotonic()
            results = await self.backend.generate(requests)
            self.gather.batch_done(len(live), time.monotonic() - started)
            for req, completions in zip(live, results, strict=True):
                self.send(GenerateResult(req.request_id, req.origin, "", [completion_to_wire(c) for c in completions]))
            self.served += len(live)
        finally:
            await self.gate.release_read()

    async def _update(self, version: int) -> None:
        await self.gate.acquire_write()
        try:
            t0 = time.monotonic()
            error = ""
            try:
                await asyncio.to_thread(self.backend.update_weights, version)
            except ValueError as e:  # manifest mismatch or wrong version: reported; the router stops the run
                error = str(e)
            log.info("weights v%d loaded in %.3fs%s", version, time.monotonic() - t0, f" ({error})" if error else "")
            self.send(WeightsLoaded(self.policy, version, self.peer_id, error))
        finally:
            await self.gate.release_write()
