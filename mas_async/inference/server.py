"""The inference server: serves one policy with a backend and loads version-tagged weights.

Requests queue as they arrive; the batching task takes everything queued and hands it to the backend
as one batch (dynamic batching; a backend with continuous batching, like vLLM, may have several batches
in flight). A backend that runs one batch at a time first waits for the rest of the wave of requests
the episodes are sending (`WaveGather`). Every completion carries the `weight_version` of the weights
that produced it.

A replica that replaces a lost one does not join the weight group's first generation: it waits for the
router's ReformWeightGroup, as the live replicas do, joins the new generation with them and loads the
version the trainer sends there before the router gives it a request. An UpdateWeights of another
generation than the one joined (a send in flight when the group was re-formed) is ignored, and a receive
abandoned because its generation was retired (or broken by a lost peer) reports nothing: the trainer
sends again in the new one.

A weight update (UpdateWeights from the policy's trainer) goes through `UpdateGate`: it waits until the
batches in flight are done and holds back new ones, receives every tensor of the broadcast, loads them,
bumps the version, acknowledges WeightsLoaded, and only then lets queued requests through. So no request
is ever served by a mix of two versions. A request past its deadline, or with a value out of range
(`GenerateLimits`: n, max_tokens, the prompt, sampling parameters), is answered with an error instead of
being generated.

With bounded staleness (`rollout.max_staleness` >= 1) a backend that can receive without disturbing what
it serves (`receive_weights` and `apply_weights`: the threaded hf and mock backends, whose double-buffered
receive writes the set not being served) keeps generating during the broadcast; the gate is taken only to
swap the weights, after the batch in flight finishes on the old ones. A backend without them (vLLM:
its engine core runs the receive between scheduler steps, which would change the weights under running
requests) drains: requests already running finish on the old weights, new ones wait for the update.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from mas_async.config import Config
from mas_async.deployment import Deployment
from mas_async.inference.backends.base import make_backend
from mas_async.inference.gate import UpdateGate
from mas_async.inference.limits import GenerateLimits
from mas_async.inference.request import GenerationRequest
from mas_async.inference.wave import WaveGather
from mas_async.lora import starting_point
from mas_async.runtime.actor import DIED_AT_ENV, Peer
from mas_async.runtime.log_limit import printable
from mas_async.weights.group import GroupRetired, WeightGroupSpec, WeightSyncError
from mas_async.wire.messages import (
    Generate,
    GenerateResult,
    Message,
    ReformWeightGroup,
    UpdateWeights,
    WeightsLoaded,
    completion_to_wire,
)

log = logging.getLogger("mas_async.inference")


class BackendHung(TimeoutError):
    """The backend did not return a generate call long after its requests' deadlines."""


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
            keys_dir=deployment.keys_dir,
        )
        self.cfg = config
        self.deployment = deployment
        self.replica = replica
        self.weight_group = WeightGroupSpec.of(config, deployment, policy) if deployment.training else None
        # A LoRA policy in training serves its base with adapters; served without training (eval), its
        # weights are a plain model folder (a checkpoint holds the merged model).
        model_path, lora = starting_point(deployment, policy, spec.lora if deployment.training else None)
        self.backend = make_backend(
            spec.backend,
            model_path,
            dtype=spec.dtype,
            max_batch_sequences=spec.max_batch_sequences,
            seed=config.run.seed * 1000 + replica,
            device=spec.server_device or spec.device,
            lora=lora,
        )
        self.backend.version = deployment.start_version
        self.limits = GenerateLimits.of(config, policy, model_path, self.backend)
        self.refused = 0
        """Generate requests answered with an error because a value was out of range."""
        self._queue: list[Generate] = []
        self._wakeup = asyncio.Event()
        self.gather = WaveGather(spec.batch_gather_ms / 1000, spec.batch_gather_fraction, spec.max_batch_sequences)
        self.gate = UpdateGate()
        self._updates = asyncio.Lock()
        """One weight update at a time (a second receive would write the set the first one filled)."""
        self.overlap_updates = config.rollout.max_staleness > 0 and hasattr(self.backend, "receive_weights")
        """Receive while generating, then swap (bounded staleness); else drain first (strict mode)."""
        self.generation = -1
        """The generation of the weight group joined (-1: none yet)."""
        self._ordered = 0
        """The newest generation the router ordered."""
        self.replacement = bool(os.environ.get(DIED_AT_ENV))
        """This process replaces a lost replica: it joins the generation the router re-forms, not the first."""

    async def main(self) -> None:
        if not self.deployment.training:  # mas-async eval: fixed weights, no trainer to listen to
            await self._batch_loop()
            return
        if not self.replacement:
            await self._join(0)
        await self._batch_loop()

    async def _join(self, generation: int) -> bool:
        """Join generation `generation` of the weight group, unless a newer one was ordered (False then)."""
        assert self.weight_group is not None
        async with self._updates:
            if generation < self._ordered or generation <= self.generation:
                return False
            args = self.weight_group.join_args(1 + self.replica, generation)
            try:
                await asyncio.to_thread(self.backend.join_weight_group, **args)
            except GroupRetired as e:
                log.warning("%s", e)
                return False
            self.generation = generation
            log.info("weight group of %s joined as rank %d (generation %d)", self.policy, 1 + self.replica, generation)
            return True

    async def on_message(self, msg: Message) -> None:
        if isinstance(msg, Generate):
            error = self.limits.check(msg)
            if error:
                self.refused += 1
                if n := self.warnings.due("refused"):
                    log.warning("refused a request of %s (%d so far): %s", printable(msg.origin), n, error)
                self.send(GenerateResult(msg.request_id, msg.origin, error, []))
                return
            self._queue.append(msg)
            self._wakeup.set()
            self.gather.arrived()
        elif isinstance(msg, UpdateWeights):
            self.spawn(self._update(msg.version, msg.generation), f"update-v{msg.version}")
        elif isinstance(msg, ReformWeightGroup) and self.weight_group is not None:
            self._ordered = max(self._ordered, msg.generation)
            self.spawn(self._join(msg.generation), f"join-{msg.generation}")
        else:
            self.unexpected(msg)

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
            # The requests' callers give up at their deadline; a backend still busy request_timeout_s later
            # is hung, and a hung replica must stop (the launcher restarts it) rather than hold its gate.
            bound = max(r.deadline for r in live) - now + self.cfg.rollout.request_timeout_s
            try:
                results = await asyncio.wait_for(self.backend.generate(requests), bound)
            except TimeoutError:
                raise BackendHung(
                    f"{self.peer_id}: the backend's generate of {len(live)} requests did not return within {bound:.0f} s "
                    f"(the latest deadline plus rollout.request_timeout_s)"
                ) from None
            self.gather.batch_done(len(live), time.monotonic() - started)
            for req, completions in zip(live, results, strict=True):
                self.send(GenerateResult(req.request_id, req.origin, "", [completion_to_wire(c) for c in completions]))
        finally:
            await self.gate.release_read()

    async def _update(self, version: int, generation: int) -> None:
        async with self._updates:
            if generation != self.generation:  # sent in a generation this replica is not (or no longer) in
                log.info(
                    "ignored the send of v%d in generation %d (in generation %d)", version, generation, self.generation
                )
                return
            t0 = time.monotonic()
            error = ""
            try:
                if self.overlap_updates:
                    tensors = await asyncio.to_thread(self.backend.receive_weights, version)
                    async with self._writing():
                        self.backend.apply_weights(version, tensors)
                else:
                    async with self._writing():
                        await asyncio.to_thread(self.backend.update_weights, version)
            except WeightSyncError as e:  # retired, or broken by a lost replica: the router has the group re-formed
                log.warning(
                    "the receive of v%d was abandoned (%s); the trainer sends again in the re-formed group", version, e
                )
                if not isinstance(e, GroupRetired):
                    self.spawn(self._expect_reform(version, generation, str(e)), f"expect-reform-{generation}")
                return
            except ValueError as e:  # manifest mismatch or wrong version: reported; the router stops the run
                error = str(e)
            log.info("weights v%d loaded in %.3fs%s", version, time.monotonic() - t0, f" ({error})" if error else "")
            self.send(WeightsLoaded(self.policy, version, self.peer_id, error))

    async def _expect_reform(self, version: int, generation: int, error: str) -> None:
        """A receive broke without its generation being retired (its pair with a lost rank closed): a re-form
        must follow. If none is ordered within the weight-sync bound, the error is reported (the router
        stops the run, naming it) rather than waited on for ever."""
        timeout_s = self.cfg.trainer.weight_sync_timeout_s
        await asyncio.sleep(timeout_s)
        if self._ordered <= generation:
            why = f"the receive failed and no re-formed weight group was ordered within {timeout_s:g}s: {error}"
            self.send(WeightsLoaded(self.policy, version, self.peer_id, why))

    @contextlib.asynccontextmanager
    async def _writing(self):
        """Hold the gate's write side: no batch runs (the one in flight finishes first)."""
        await self.gate.acquire_write()
        try:
            yield
        finally:
            await self.gate.release_write()
