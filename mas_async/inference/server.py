"""The inference server: serves a policy with a backend and loads version-tagged weights.

In training, the servers of a policy also serve the policies that share its base (`policies.<p>.base`):
each request names its policy, each policy has its own adapters, weight group and version, and a batch
holding several policies' requests runs one policy at a time.

Requests come from the router, and with `cluster.leases` also straight from the env workers on the
replica's own socket (`direct.py`); both are served alike, and each result goes back the way its request
came. Requests queue as they arrive; the batching task takes everything queued and hands it to the backend
as one batch (dynamic batching; a backend with continuous batching, like vLLM, may have several batches
in flight). A backend that runs one batch at a time first waits for the rest of the wave of requests
the episodes are sending (`WaveGather`). Every completion carries the `weight_version` of the weights
that produced it.

The weight group's membership is the router's (router/membership.py): each ReformWeightGroup names the
replicas of a new generation, this one's rank among them, and the replacements that catch up first. A
replica that replaces a lost one does not join the first generation: once its model is loaded it says
Hello, and the router's order has it join a generation of its own with the trainer (`fresh`), where it
receives the version the others hold, then the new generation with them; the router gives it requests
once it reported that version. A live replica keeps serving while it joins a new generation (the join
does not take the update gate), and receives nothing it holds already. An UpdateWeights of another
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
from mas_async.devices import to_thread, use_device
from mas_async.inference.backends.base import InferenceBackend, make_backend
from mas_async.inference.backends.vllm_args import engine_args
from mas_async.inference.direct import DirectRequests
from mas_async.inference.gate import UpdateGate
from mas_async.inference.limits import GenerateLimits
from mas_async.inference.request import GenerationRequest
from mas_async.inference.wave import WaveGather
from mas_async.lora import starting_point
from mas_async.runtime.actor import DIED_AT_ENV, Peer
from mas_async.runtime.log_limit import printable
from mas_async.weights.group import GroupRetired, WeightGroupSpec, WeightSyncError
from mas_async.wire.messages import (
    NO_SEED,
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
            heartbeat_s=config.heartbeat_interval_s(),
            peer_timeout_s=cluster.peer_timeout_s,
            startup_timeout_s=cluster.startup_timeout_s,
            keys_dir=deployment.keys_dir,
        )
        self.cfg = config
        self.deployment = deployment
        self.replica = replica
        self.served = config.served_policies(policy, deployment.training)
        """The policies whose requests this server takes: its own, then those that share its base."""
        self.weight_groups = (
            {p: WeightGroupSpec.of(config, deployment, p) for p in self.served} if deployment.training else {}
        )
        # A LoRA policy in training serves its base with adapters; served without training (eval), its
        # weights are a plain model folder (a checkpoint holds the merged model).
        model_path, lora = starting_point(deployment, policy, spec.lora if deployment.training else None)
        device = spec.servers_on()  # None: a backend that places itself (vLLM) is never handed a device
        if device is not None:
            use_device(device, f"inference server {policy}/{replica}")
        guests = {p: starting_point(deployment, p, config.policies[p].lora)[1] for p in self.served[1:]}
        self.backend = make_backend(
            spec.backend,
            model_path,
            dtype=spec.dtype,
            max_batch_sequences=spec.max_batch_sequences,
            seed=config.run.seed * 1000 + replica,
            device=device,
            lora=lora,
            guests=guests,
            engine_args=engine_args(config, self.peer_id),
        )
        self.guests = {p: self.backend.guest(p) for p in guests}
        """policy -> the backend of a policy that shares this one's base: a view of the same engine."""
        for backend in (self.backend, *self.guests.values()):
            backend.version = deployment.start_version
        self.limits = GenerateLimits.of(config, policy, model_path, self.backend)
        self.refused = 0
        """Generate requests answered with an error because a value was out of range."""
        self._queue: list[Generate] = []
        self._wakeup = asyncio.Event()
        self.gather = WaveGather(spec.batch_gather_ms / 1000, spec.batch_gather_fraction, spec.max_batch_sequences)
        self.gate = UpdateGate()
        self._updates = {p: asyncio.Lock() for p in self.served}
        """One weight update of a policy at a time (a second receive would write the set the first one filled)."""
        self.overlap_updates = config.rollout.max_staleness > 0 and hasattr(self.backend, "receive_weights")
        """Receive while generating, then swap (bounded staleness); else drain first (strict mode)."""
        self.generation = dict.fromkeys(self.served, -1)
        """policy -> the generation of its weight group joined (-1: none yet)."""
        self._ordered = dict.fromkeys(self.served, 0)
        """policy -> the newest generation of its weight group the router ordered."""
        self._caught_up: dict[tuple[str, int], asyncio.Event] = {}
        """(policy, catch-up generation) -> set once the version sent there is loaded."""
        self.replacement = bool(os.environ.get(DIED_AT_ENV))
        """This process replaces a lost replica: it joins the generation the router re-forms, not the first."""
        self.direct: DirectRequests | None = None
        """With `cluster.leases`: the socket the env workers send their requests to directly."""

    async def setup(self) -> None:
        """With `cluster.leases`, bind the direct socket first: its endpoint goes into the Hello."""
        if self.cfg.cluster.leases:
            assert self.ctx is not None
            address = self.deployment.address(self.peer_id)
            self.direct = DirectRequests(self.ctx, address, self.keys_dir, self._take, self.curve_secret)
            self.endpoint = self.direct.start(self.spawn)
        await super().setup()

    async def cleanup(self) -> None:
        if self.direct is not None:
            log.info(
                "took %d requests directly (%d refused, %d malformed, %d refused handshakes)",
                self.direct.taken, self.direct.refused, self.direct.malformed, self.direct.refusals.count,
            )  # fmt: skip

    async def main(self) -> None:
        if not self.deployment.training:  # mas-async eval: fixed weights, no trainer to listen to
            await self._batch_loop()
            return
        if not self.replacement:  # (a replacement waits for the order that adds it)
            first = [self._join(policy, 0, 1 + self.replica, self.weight_groups[policy].world_size, 0)
                     for policy in self.served]  # fmt: skip
            await asyncio.gather(*first)
        await self._batch_loop()

    async def _join(self, policy: str, generation: int, rank: int, world_size: int, order: int) -> bool:
        """Join generation `generation` of `policy`'s weight group as `rank` of `world_size`, for the order of
        generation `order`, unless a newer order came (False then)."""
        async with self._updates[policy]:
            if order < self._ordered[policy] or generation <= self.generation[policy]:
                return False
            args = self.weight_groups[policy].join_args(rank, generation, world_size)
            try:
                await to_thread(self.backend_of(policy).join_weight_group, **args)
            except GroupRetired as e:
                log.warning("%s", e)
                return False
            self.generation[policy] = generation
            log.info("weight group of %s joined as rank %d of %d (generation %d)", policy, rank, world_size, generation)
            return True

    async def _reform(self, order: ReformWeightGroup) -> None:
        """Carry out the router's order: catch up first if this replica is fresh, then join its generation."""
        policy, me = order.policy, self.replica
        if me not in order.members:
            log.info("not a member of generation %d of %s's weight group", order.generation, policy)
            return
        if me in order.fresh:
            catch_up = order.generation - 1
            loaded = self._caught_up.setdefault((policy, catch_up), asyncio.Event())
            if not await self._join(
                policy, catch_up, 1 + order.fresh.index(me), 1 + len(order.fresh), order.generation
            ):
                return
            timeout_s = self.cfg.trainer.weight_sync_timeout_s
            try:
                await asyncio.wait_for(loaded.wait(), timeout_s)
            except TimeoutError:  # the trainer's send failed: the router orders again (or the run restarts)
                log.warning("no version came in catch-up generation %d of %s within %gs", catch_up, policy, timeout_s)
                return
            finally:
                self._caught_up.pop((policy, catch_up), None)
        await self._join(
            policy, order.generation, 1 + order.members.index(me), 1 + len(order.members), order.generation
        )

    async def on_message(self, msg: Message) -> None:
        if isinstance(msg, Generate):
            self._take(msg)
        elif isinstance(msg, UpdateWeights) and msg.policy in self.weight_groups:
            self.spawn(self._update(msg.policy, msg.version, msg.generation), f"update-{msg.policy}-v{msg.version}")
        elif isinstance(msg, ReformWeightGroup) and msg.policy in self.weight_groups:
            if msg.generation > self._ordered[msg.policy]:
                self._ordered[msg.policy] = msg.generation
                self.spawn(self._reform(msg), f"reform-{msg.policy}-{msg.generation}")
        else:
            self.unexpected(msg)

    def _take(self, msg: Generate) -> None:
        """Queue a request (from the router or the direct socket), or answer it with the error in its values."""
        error = self.limits.check(msg) or self._serves(msg.policy)
        if error:
            self.refused += 1
            if n := self.warnings.due("refused"):
                log.warning("refused a request of %s (%d so far): %s", printable(msg.origin), n, error)
            self._reply(msg, GenerateResult(msg.request_id, msg.origin, error, []))
            return
        self._queue.append(msg)
        self._wakeup.set()
        self.gather.arrived()

    def _reply(self, request: Generate, result: GenerateResult) -> None:
        """Send `result` back the way `request` came: on the direct socket's connection, or to the router."""
        if self.direct is None or not self.direct.reply(request, result):
            self.send(result)

    def _serves(self, policy: str) -> str:
        """ "" when this server serves `policy`, else why not."""
        return "" if policy in self.served else f"Generate.policy={policy!r}: this server serves {self.served}"

    def backend_of(self, policy: str) -> InferenceBackend:
        """The backend that serves `policy`: this server's own, or a guest's view of it."""
        return self.backend if policy == self.policy else self.guests[policy]

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
                    self._reply(
                        req, GenerateResult(req.request_id, req.origin, "deadline passed before generation", [])
                    )
                else:
                    live.append(req)
            if not live:
                return
            started = time.monotonic()
            for policy in self.served:  # (one policy's requests at a time: each runs with its own adapters)
                of_policy = [r for r in live if r.policy == policy]
                if of_policy:
                    await self._generate(policy, of_policy, now)
            self.gather.batch_done(len(live), time.monotonic() - started)
        finally:
            await self.gate.release_read()

    async def _generate(self, policy: str, live: list[Generate], now: float) -> None:
        """Generate `policy`'s requests `live` and send their results."""
        requests = [
            GenerationRequest(
                prompt_ids=r.prompt_ids,
                n=r.n,
                max_tokens=r.max_tokens,
                temperature=r.temperature,
                top_p=r.top_p,
                greedy=r.greedy,
                stop_token_ids=list(r.stop_token_ids),
                seed=None if r.seed == NO_SEED else r.seed,
                top_logprobs=r.top_logprobs,
            )  # fmt: skip
            for r in live
        ]
        # The requests' callers give up at their deadline; a backend still busy request_timeout_s later
        # is hung, and a hung replica must stop (the launcher restarts it) rather than hold its gate.
        bound = max(r.deadline for r in live) - now + self.cfg.rollout.request_timeout_s
        try:
            results = await asyncio.wait_for(self.backend_of(policy).generate(requests), bound)
        except TimeoutError:
            raise BackendHung(
                f"{self.peer_id}: the backend's generate of {len(live)} requests did not return within {bound:.0f} s "
                f"(the latest deadline plus rollout.request_timeout_s)"
            ) from None
        for req, completions in zip(live, results, strict=True):
            self._reply(
                req, GenerateResult(req.request_id, req.origin, "", [completion_to_wire(c) for c in completions])
            )

    async def _update(self, policy: str, version: int, generation: int) -> None:
        backend = self.backend_of(policy)
        async with self._updates[policy]:
            if generation != self.generation[policy]:  # sent in a generation this replica is not (or no longer) in
                log.info(
                    "ignored the send of %s v%d in generation %d (in generation %d)",
                    policy, version, generation, self.generation[policy],
                )  # fmt: skip
                return
            t0 = time.monotonic()
            error = ""
            try:
                if self.overlap_updates:
                    tensors = await to_thread(backend.receive_weights, version)
                    async with self._writing():
                        backend.apply_weights(version, tensors)
                else:
                    async with self._writing():
                        await to_thread(backend.update_weights, version)
            except WeightSyncError as e:  # retired, or broken by a lost replica: the router has the group re-formed
                log.warning(
                    "the receive of %s v%d was abandoned (%s); the trainer sends again in the re-formed group",
                    policy, version, e,
                )  # fmt: skip
                if not isinstance(e, GroupRetired):
                    reform = self._expect_reform(policy, version, generation, str(e))
                    self.spawn(reform, f"expect-reform-{policy}-{generation}")
                return
            except ValueError as e:  # manifest mismatch or wrong version: reported; the router stops the run
                error = str(e)
            took, why = time.monotonic() - t0, f" ({error})" if error else ""
            log.info("weights v%d loaded in %.3fs for %s%s", version, took, policy, why)
            self.send(WeightsLoaded(policy, version, self.peer_id, error))
            if not error and (caught_up := self._caught_up.get((policy, generation))) is not None:
                caught_up.set()

    async def _expect_reform(self, policy: str, version: int, generation: int, error: str) -> None:
        """A receive broke without its generation being retired (its pair with a lost rank closed): a re-form
        must follow. If none is ordered within the weight-sync bound, the error is reported (the router
        stops the run, naming it) rather than waited on for ever."""
        timeout_s = self.cfg.trainer.weight_sync_timeout_s
        await asyncio.sleep(timeout_s)
        if self._ordered[policy] <= generation:
            why = f"the receive failed and no re-formed weight group was ordered within {timeout_s:g}s: {error}"
            self.send(WeightsLoaded(policy, version, self.peer_id, why))

    @contextlib.asynccontextmanager
    async def _writing(self):
        """Hold the gate's write side: no batch runs (the one in flight finishes first)."""
        await self.gate.acquire_write()
        try:
            yield
        finally:
            await self.gate.release_write()
