"""The env worker: hosts env instances and runs many episodes concurrently as asyncio tasks.

It holds the tokenizers (not the models): prompts are tokenised here with each policy's chat template
and the token ids are the truth from then on. Every generate request goes through the router to an
inference server of the agent's policy, with a request id and a deadline; with `cluster.leases` it goes
straight to a replica the router leased to this worker (`leases.py`, `direct_link.py`). When an episode
ends, its recorded groups go to the router as one Groups message per policy (routed to that policy's
trainer; with `cluster.leases` straight to the trainer rank its RunEpisode names, which trains them once
the router accepts the episode), then an EpisodeDone with the episode's summary; when groups stream by
turn (`Config.streams_turns`) each group goes to the router as it is recorded instead. An exception in an
episode (a bug in a node, an env or a workflow) fails that episode only: it is reported in
EpisodeDone.error and counted as dropped, and the worker lives on. A "baseline/<name>" episode is played
by the env's reference policy <name> (`BaselineEpisode`, its expectation on the problem: `ExpectedBaselines`):
no request, no groups, only its EpisodeDone. With a `workflow.program` (agents
written against the OpenAI API) the worker also serves the OpenAI-compatible gateway
(`mas_async.gateway`) on its own event loop, and each episode is a `GatewayEpisode` whose program calls it.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import logging
import random
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mas_async import sandbox
from mas_async.api.priority import episode_iteration, episode_ordinal
from mas_async.api.registry import ENVS, WORKFLOWS, resolve
from mas_async.config import Config
from mas_async.deployment import Deployment
from mas_async.peer_names import trainer_peer
from mas_async.rollout.baseline import (
    BaselineEpisode,
    ExpectedBaselines,
    baseline_name,
    draws_per_episode,
    exact_paths,
)
from mas_async.rollout.direct_link import DirectLink
from mas_async.rollout.episode import Episode, candidates_per_turn, greedy_decoding
from mas_async.rollout.leases import ROUTER, LeaseClient
from mas_async.rollout.nodes import build_nodes
from mas_async.runtime.actor import Peer
from mas_async.wire.codec import CodecError
from mas_async.wire.messages import (
    NO_SEED,
    EpisodeDone,
    Generate,
    GenerateResult,
    Groups,
    GroupsReceived,
    Lease,
    Message,
    RunEpisode,
    Trainers,
    completion_from_wire,
    decode,
    encode,
    samples_to_wire,
)

if TYPE_CHECKING:
    from mas_async.gateway.episode import GatewayEpisode
    from mas_async.gateway.server import Gateway
    from mas_async.wire.samples import Completion, Sample

log = logging.getLogger("mas_async.rollout.env_worker")


class GenerateError(RuntimeError):
    """An inference server could not serve a request (the reply names why)."""


class GroupsRefused(RuntimeError):
    """A trainer refused an episode's groups sent straight to it, or did not confirm them in time."""


def load_tokenizer(path: str):
    """The tokenizer of a model folder: the class its tokenizer_config.json names, loaded directly when
    transformers has it (AutoTokenizer loads the same class, but only after importing the configs of every
    model family: ~5 s of CPU in each env worker), else through AutoTokenizer."""
    import transformers

    try:
        name = json.loads((Path(path) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        name = None
    try:
        cls = getattr(transformers, name) if isinstance(name, str) else None
    except (AttributeError, ImportError):  # not a class of this transformers, or its backend is missing
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase)):
        cls = transformers.AutoTokenizer
    tokenizer = cls.from_pretrained(path)
    no_whole_text_cache(tokenizer)
    return tokenizer


def no_whole_text_cache(tokenizer) -> None:
    """Turn off the word cache of a fast BPE tokenizer that has no pre-tokenizer (the built-in tiny-char one).

    A fast BPE tokenizer keeps every word it has split, up to 10,000 words of under 256 characters, for the
    process's life. After a pre-tokenizer a word is a word: a few hundred bytes each, hit often. Without one,
    all the text between two special tokens is one "word" (a prompt's observation: ~32 bytes a character,
    hardly ever seen twice), so an env worker's memory grows for its first ~10 minutes by ~15 MB a policy on
    the demo, up to ~85 MB a policy on longer observations, and then stays there (docs/faults.md)."""
    from tokenizers.models import BPE

    backend = getattr(tokenizer, "backend_tokenizer", None)  # (a slow tokenizer has none, and no such cache)
    if backend is not None and backend.pre_tokenizer is None and isinstance(backend.model, BPE):
        backend.model._resize_cache(0)  # (a capacity of 0 keeps nothing; tokenizers has no public setter)


def stop_token_ids(tokenizer) -> list[int]:
    """End-of-turn tokens: eos and, for chat templates of the Qwen family, <|im_end|>."""
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)


class EnvWorker(Peer):
    role = "env_worker"

    def __init__(self, config: Config, deployment: Deployment, index: int) -> None:
        cluster = config.cluster
        super().__init__(
            f"env_worker/{index}",
            deployment.router_endpoint,
            capacity=config.rollout.episodes_per_worker,
            heartbeat_s=config.heartbeat_interval_s(),
            peer_timeout_s=cluster.peer_timeout_s,
            startup_timeout_s=cluster.startup_timeout_s,
            keys_dir=deployment.keys_dir,
        )
        self.cfg = config
        self.arrived: dict[int, int] = {}
        """iteration -> its episodes that came so far (their order is their priority under a streamed step);
        the two newest iterations only."""
        self.env_cls = resolve(config.env.name, ENVS, "env")
        sandbox.configure(config.sandbox.unsafe_no_isolation, config.sandbox.cgroup_root)
        if self.env_cls.runs_code:
            sandbox.require_isolation()  # no silent fallback: a sentence saying what to install
        self.policy_of = config.policy_of()
        self.baselines = ExpectedBaselines(draws_per_episode(config), exact_paths(config, self.env_cls))
        """Reference policies' expected summaries (exact ones kept by problem)."""
        self.tokenizers = {p: load_tokenizer(deployment.model_paths[p]) for p in config.policies}
        self.stop_ids = {p: stop_token_ids(tok) for p, tok in self.tokenizers.items()}
        self.gateway: Gateway | None = None
        if config.workflow.program is not None:  # aiohttp and openai are imported by such runs only
            from mas_async.gateway.access import listener
            from mas_async.gateway.server import Gateway, Limits
            from mas_async.gateway.workflow import ProgramWorkflow, load_program

            self.workflow = ProgramWorkflow(load_program(config.workflow.program), config.workflow.options)
            # loopback (gateway.host), or gateway.external: its node's address and the run's token
            host, port, access = listener(config, deployment, self.peer_id, index)
            self.gateway = Gateway(
                policy_of=self.policy_of,
                tokenizers=self.tokenizers,
                generate=self.generate,
                limits=Limits.of(config),
                template_kwargs={p: spec.chat_template_kwargs for p, spec in config.policies.items()},
                host=host,
                port=port,
                generate_errors=(GenerateError,),
                access=access,
                in_process=config.gateway.in_process,
            )
        else:
            workflow_cls = resolve(config.workflow.name, WORKFLOWS, "workflow")
            nodes = build_nodes(config)
            self.workflow = workflow_cls(nodes, **config.workflow.options)
        # Request ids start at random: a restarted worker's requests never take the ids of its
        # predecessor's, whose late results the router still forwards to this identity (they are dropped).
        self._ids = itertools.count(random.SystemRandom().getrandbits(48))
        self._pending: dict[int, asyncio.Future[list[Completion]]] = {}
        self._episodes: dict[str, asyncio.Task] = {}
        self.leases: LeaseClient | None = None
        """With `cluster.leases`: where each request goes (a leased replica, or the router)."""
        if config.cluster.leases:
            self.leases = LeaseClient(connect=self._link, via_router=self.send_frames)
        self.trainers: dict[str, DirectLink] = {}
        """With `cluster.leases`: trainer name -> the link to its direct socket (`Trainers`), for the Groups."""
        self._received: dict[tuple[str, int, str, int], asyncio.Future[str]] = {}
        """(policy, iteration, episode id, attempt) -> the trainer's answer to its Groups (`GroupsReceived`)."""

    def _link(self, replica: str, endpoint: str) -> DirectLink:
        """A new link to a leased replica's direct socket."""
        assert self.ctx is not None
        return DirectLink(
            self.ctx, replica, endpoint, worker=self.peer_id, keys_dir=self.keys_dir, on_frames=self._on_direct,
            spawn=self.spawn, secret=self.curve_secret,
        )  # fmt: skip

    async def setup(self) -> None:
        if self.gateway is not None:  # serving before the first RunEpisode can arrive
            import openai  # noqa: F401  (the programs' clients: ~1.5 s of imports, paid before any episode)

            await self.gateway.start()
        await super().setup()

    async def cleanup(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop()

    async def on_message(self, msg: Message) -> None:
        if isinstance(msg, RunEpisode):
            task = asyncio.get_running_loop().create_task(self._run_episode(msg), name=msg.episode_id)
            self._episodes[msg.episode_id] = task
            task.add_done_callback(lambda _t, e=msg.episode_id: self._episodes.pop(e, None))
        elif isinstance(msg, GenerateResult):
            self._on_result(ROUTER, msg)
        elif isinstance(msg, Lease) and self.leases is not None:
            self.leases.update(msg)
        elif isinstance(msg, Trainers) and self.leases is not None:
            self._connect_trainers(msg)
        else:
            self.unexpected(msg)

    def _connect_trainers(self, msg: Trainers) -> None:
        """Connect to every trainer's direct socket (the router sends them once, when this worker joins)."""
        for entry in msg.endpoints:
            if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(v, str) for v in entry)):
                log.warning("dropped a Trainers message: an entry is not [trainer name, endpoint]")
                return
        assert self.ctx is not None
        for name, endpoint in msg.endpoints:
            if name.startswith("trainer/") and endpoint.startswith("tcp://") and name not in self.trainers:
                self.trainers[name] = DirectLink(
                    self.ctx, name, endpoint, worker=self.peer_id, keys_dir=self.keys_dir, on_frames=self._on_trainer,
                    spawn=self.spawn, secret=self.curve_secret,
                )  # fmt: skip

    async def _send_groups(self, groups: Groups, rank: int) -> None:
        """An episode's groups of a policy: straight to its trainer rank when linked (returns once the trainer
        holds them: the EpisodeDone that follows is then safe to send), else through the router. Raises
        GroupsRefused when the trainer refused them or did not answer within `cluster.peer_timeout_s`."""
        name = trainer_peer(groups.policy, rank)
        link = self.trainers.get(name)
        if link is None:
            self.send(groups)
            return
        key = (groups.policy, groups.iteration, groups.episode_id, groups.attempt)
        answer = self._received[key] = asyncio.get_running_loop().create_future()
        try:
            link.send(encode(groups))
            timeout_s = self.cfg.cluster.peer_timeout_s
            try:
                error = await asyncio.wait_for(answer, timeout_s)
            except TimeoutError:
                raise GroupsRefused(f"{name} did not confirm the episode's groups within {timeout_s:g}s") from None
            if error:
                raise GroupsRefused(f"{name} refused the episode's groups: {error}")
        finally:
            self._received.pop(key, None)

    def _decoded(self, source: str, frames: list, kind: type[Message]) -> Message | None:
        """A message from a direct link (a replica's or a trainer's socket) if it decodes and is a `kind`;
        otherwise None, counted (malformed) or logged (unexpected), rate-limited."""
        try:
            msg = decode([f.buffer for f in frames])
        except CodecError as e:
            self.malformed += 1
            if n := self.warnings.due(("malformed direct", kind)):
                log.warning("dropped a malformed message from %s (%d so far): %s", source, n, e)
            return None
        if isinstance(msg, kind):
            return msg
        if n := self.warnings.due(("unexpected direct", type(msg))):
            log.warning("dropped an unexpected %s from %s (%d so far)", type(msg).__name__, source, n)
        return None

    def _on_trainer(self, trainer: str, frames: list) -> None:
        """A message from a trainer's direct socket: only its answer to a Groups (`GroupsReceived`) is taken."""
        msg = self._decoded(trainer, frames, GroupsReceived)
        if msg is None:
            return
        assert isinstance(msg, GroupsReceived)
        answer = self._received.get((msg.policy, msg.iteration, msg.episode_id, msg.attempt))
        if answer is None or answer.done():
            if n := self.warnings.due("unwaited answer"):
                log.warning("dropped an answer from %s to groups no episode waits for (%d so far)", trainer, n)
            return
        answer.set_result(msg.error)

    def _on_direct(self, replica: str, frames: list) -> None:
        """A message from a leased replica's direct socket: only a GenerateResult is taken."""
        msg = self._decoded(replica, frames, GenerateResult)
        if msg is not None:
            assert isinstance(msg, GenerateResult)
            self._on_result(replica, msg)

    def _on_result(self, source: str, msg: GenerateResult) -> None:
        """The result of a request, from the router (ROUTER) or a leased replica: taken only from where the
        request is now (`LeaseClient.accept`), and only while it is waited for."""
        if self.leases is not None and not self.leases.accept(source, msg.request_id):
            return  # counted as stale
        future = self._pending.pop(msg.request_id, None)
        if future is None or future.done():
            return  # the request timed out already
        if msg.error:
            future.set_exception(GenerateError(msg.error))
        else:
            future.set_result([completion_from_wire(c) for c in msg.completions])

    async def generate(
        self,
        policy: str,
        prompt_ids: np.ndarray,
        n: int,
        greedy: bool,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        top_logprobs: int = 0,
    ) -> list[Completion]:
        """One request with n samples to an inference server of `policy`, via the router or a leased replica
        (max_tokens and temperature: the run's `rollout` values unless given). `seed`: sample i draws from a
        generator seeded with seed + i (None: the server's own); `top_logprobs`: k alternatives per sampled
        token (`Completion.top_ids`, `top_logprobs`; the gateway's, never trained on)."""
        rollout = self.cfg.rollout
        max_tokens = rollout.max_tokens if max_tokens is None else max_tokens
        temperature = rollout.temperature if temperature is None else temperature
        request_id = next(self._ids)
        future: asyncio.Future[list[Completion]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        deadline = time.time() + rollout.request_timeout_s
        msg = Generate(
            request_id, policy, self.peer_id, deadline, np.asarray(prompt_ids, dtype=np.int32), n, max_tokens,
            temperature, rollout.top_p, greedy, self.stop_ids[policy], NO_SEED if seed is None else seed, top_logprobs,
        )  # fmt: skip
        if self.leases is None:
            self.send(msg)
        else:
            self.leases.submit(msg)
        try:
            return await asyncio.wait_for(future, rollout.request_timeout_s)
        except TimeoutError:
            raise GenerateError(
                f"generate request {request_id} to policy {policy!r} timed out after {rollout.request_timeout_s}s"
            ) from None
        finally:
            self._pending.pop(request_id, None)
            if self.leases is not None:
                self.leases.forget(request_id)

    def arrival(self, iteration: int) -> int:
        """The place of an episode of `iteration` that just came among that iteration's episodes here."""
        ordinal = self.arrived.get(iteration, 0)
        self.arrived[iteration] = ordinal + 1
        for old in [i for i in self.arrived if i < iteration - 1]:
            del self.arrived[old]
        return ordinal

    async def _run_episode(self, msg: RunEpisode) -> None:
        error, summary, counts = "", {}, {}
        env = None
        episode_iteration.set(msg.iteration)  # this task's: its sandbox runs go before later iterations'
        if self.cfg.streams():  # and before those of episodes that came after it: it finishes earlier
            episode_ordinal.set(self.arrival(msg.iteration))
        try:
            name = baseline_name(msg.mode)
            if name is not None and self.gateway is None:
                summary = await self._baseline(msg, name)  # nothing generated, nothing recorded
            else:
                env = self.env_cls()
                env.reset(seed=msg.seed, options={"problem": msg.problem})
                episode = self._episode(msg, env)
                if isinstance(episode, Episode) and msg.mode == "train" and self.cfg.streams_turns():
                    episode.on_group = lambda samples: self._stream_group(msg, samples, counts)
                await self.workflow.run(episode)
                summary = episode.finish()
                by_policy = defaultdict(list)
                for sample in episode.samples[episode.streamed if isinstance(episode, Episode) else 0 :]:
                    by_policy[sample.policy].append(sample)
                for policy, samples in by_policy.items():
                    groups = self._groups_message(msg, policy, samples)
                    await self._send_groups(groups, msg.trainer_ranks.get(policy, 0))
                    counts[policy] = counts.get(policy, 0) + len(samples)
        except Exception as e:  # a failed episode is reported and counted, never a dead worker
            trace = traceback.format_exc()
            # The traceback's last frames go with the error: the router shows the first episode's when every
            # episode of an iteration fails (a bug in a workflow program), without a look in this log.
            error = f"{type(e).__name__}: {e}\n{_tail(trace)}"
            log.error("episode %s failed:\n%s", msg.episode_id, trace)
        finally:
            if env is not None:
                env.close()
        leased = self.leases.take_counts() if self.leases is not None else {}
        self.send(EpisodeDone(msg.episode_id, msg.iteration, msg.mode, msg.attempt, error, summary, counts, leased))

    async def _baseline(self, msg: RunEpisode, name: str) -> dict:
        """Reference policy `name`'s expected summary on the episode's problem (`ExpectedBaselines`): every
        play a `BaselineEpisode` on a fresh env, seeded as the episode is."""
        policies = self.env_cls.reference_policies()

        async def play(rng: random.Random) -> dict:
            env = self.env_cls()
            try:
                env.reset(seed=msg.seed, options={"problem": copy.deepcopy(msg.problem)})
                episode = BaselineEpisode(
                    name=name,
                    policies=policies,
                    rng=rng,
                    episode_id=msg.episode_id,
                    problem_id=msg.problem_id,
                    env=env,
                    policy_of=self.policy_of,
                    alpha=self.cfg.algorithm.alpha,
                    seed=msg.seed,
                )
                await self.workflow.run(episode)
                return episode.finish()
            finally:
                env.close()

        return await self.baselines.summary(name, msg.problem, msg.seed, play)

    @staticmethod
    def _groups_message(msg: RunEpisode, policy: str, samples: list[Sample]) -> Groups:
        tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
        episode = (msg.iteration, msg.episode_id, msg.attempt)
        return Groups(policy, *episode, len(samples), tokens, samples_to_wire(samples), msg.problem_episodes)

    def _stream_group(self, msg: RunEpisode, samples: list[Sample], counts: dict[str, int]) -> None:
        """A group just recorded, to the router at once (`Config.streams_turns`: its advantages need nothing
        else, so its trainer computes it while the episode plays on); `counts` adds up the episode's samples."""
        for policy in dict.fromkeys(s.policy for s in samples):
            mine = [s for s in samples if s.policy == policy]
            self.send(self._groups_message(msg, policy, mine))
            counts[policy] = counts.get(policy, 0) + len(mine)

    def _episode(self, msg: RunEpisode, env) -> Episode | GatewayEpisode:
        """The episode context of `msg`, whose model plays ("train", "eval"; a baseline is `_baseline`'s): a
        workflow program plays a `GatewayEpisode` (the config refuses baselines for it)."""
        if self.gateway is not None:
            from mas_async.gateway.episode import GatewayEpisode

            return GatewayEpisode(
                gateway=self.gateway,
                episode_id=msg.episode_id,
                problem_id=msg.problem_id,
                problem=msg.problem,
                env=env,
                policy_of=self.policy_of,
                alpha=self.cfg.algorithm.alpha,
                mode=msg.mode,
                client_timeout_s=self.cfg.rollout.request_timeout_s + 30.0,
            )
        return Episode(
            episode_id=msg.episode_id,
            problem_id=msg.problem_id,
            env=env,
            policy_of=self.policy_of,
            tokenizers=self.tokenizers,
            generate=self.generate,
            k=candidates_per_turn(self.cfg, msg.mode),
            alpha=self.cfg.algorithm.alpha,
            mode=msg.mode,
            seed=msg.seed,
            greedy=greedy_decoding(self.cfg, msg.mode),
            template_kwargs={p: spec.chat_template_kwargs for p, spec in self.cfg.policies.items()},
        )


TRACEBACK_LINES = 24
"""Lines of a failed episode's traceback sent with its error (the innermost frames: where it failed)."""


def _tail(trace: str) -> str:
    lines = trace.rstrip("\n").splitlines()
    return "\n".join(
        lines if len(lines) <= TRACEBACK_LINES else ["Traceback (innermost frames):", *lines[-TRACEBACK_LINES:]]
    )
