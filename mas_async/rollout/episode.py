"""The episode context a workflow plays through: tree-structured sampling and the groups it records.

An EnvWorker builds one `Episode` per (problem, iteration) and hands it to the workflow's
`run(episode)`. The workflow calls `await episode.act(node)` for each agent's turn, which is AT-GRPO's
tree-sampling step:

1. tokenise the node's prompt with its policy's chat template (token ids are the truth from here on),
2. ask the policy for K completions in one request (`n=K`; eval mode: one greedy completion),
3. decode and parse each, and score EVERY candidate on its own `env.clone()`, all K concurrently (an
   env may define `async astep(agent, action)`, awaited instead of `step`, to run code in the sandbox):
   `reward = alpha * clone.team_reward() + node.local_reward(before=env, action, after=clone)`;
   an unparsable candidate keeps its unchanged clone and gets `node.invalid_penalty` (never dropped),
4. only then record the group (one `Sample` per candidate, key "<episode_id>/<agent>/<turn>") and
   commit the best candidate (argmax reward, ties broken by an RNG seeded with the episode, agent and
   turn): the chosen candidate's own clone becomes `episode.env` and the episode continues from it.

Workflows that need more control (agents acting in parallel within a turn, a verifier routing to one of
two agents) use the lower-level `sample`, `record`, `commit` and `next_turn` that `act` is built from.
`finish()` stamps every sample with the episode's return and returns the episode's metrics (success,
mean reward and parse-failure rate of each agent's candidates, the share of each agent's committed moves
that the env judges good (`Env.move_quality`), turns, tokens).

`BaselineEpisode` (rollout/baseline.py) is the same episode with a reference policy of the env in the
model's place.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from mas_async.api.env import step_env
from mas_async.api.node import ParseError
from mas_async.api.priority import episode_turn
from mas_async.api.workflow import Candidate
from mas_async.metrics import Keys
from mas_async.rollout.chat_prompt import chat_prompt_ids
from mas_async.wire.samples import Completion, Sample

if TYPE_CHECKING:
    from mas_async.api.env import Env
    from mas_async.api.node import Node
    from mas_async.config import Config

# generate(policy, prompt_ids int32[P], n, greedy) -> n completions, from one request.
Generate = Callable[[str, np.ndarray, int, bool], Awaitable[list[Completion]]]
MODES = ("train", "eval")
BASELINE_PREFIX = "baseline/"
"""Mode of an episode that a reference policy of the env plays: "baseline/<name>" (`Env.reference_policies`)."""


def check_mode(mode: str) -> str:
    """`mode` if it is one an episode can have ("train", "eval", "baseline/<name>"), else a ValueError."""
    name = mode[len(BASELINE_PREFIX) :] if mode.startswith(BASELINE_PREFIX) else ""
    if mode in MODES or (name and "/" not in name):
        return mode
    raise ValueError(f"episode mode must be one of {', '.join(MODES)} or {BASELINE_PREFIX}<name>, got {mode!r}")


def candidates_per_turn(config: Config, mode: str) -> int:
    """K of an episode: `algorithm.k` candidates per turn in training under tree sampling; one under
    parallel sampling (its K lives in the number of episodes per problem) and in evaluation."""
    if mode == "train" and config.algorithm.sampling == "tree":
        return config.algorithm.k
    return 1


def episodes_per_problem(config: Config, mode: str) -> int:
    """Episodes of one problem per iteration: K under parallel sampling, eval.k in evaluation, else 1."""
    if mode == "eval":
        return config.eval.k
    return config.algorithm.k if config.algorithm.sampling == "parallel" else 1


def greedy_decoding(config: Config, mode: str) -> bool:
    """Training always samples; evaluation decodes greedily unless `eval.greedy` is false."""
    return mode == "eval" and config.eval.greedy


class Episode:
    """One episode of one problem: the committed env, the turn counter, and the recorded samples."""

    def __init__(
        self,
        *,
        episode_id: str,
        problem_id: str,
        env: Env,
        policy_of: dict[str, str],
        tokenizers: Mapping[str, Any],
        generate: Generate,
        k: int,
        alpha: float,
        mode: str = "train",
        seed: int = 0,
        greedy: bool | None = None,
        template_kwargs: Mapping[str, dict[str, Any]] | None = None,
        on_group: Callable[[list[Sample]], None] | None = None,
    ) -> None:
        check_mode(mode)
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k (candidates per turn) must be a positive integer, got {k!r}")
        missing = sorted({policy for policy in policy_of.values() if policy not in tokenizers})
        if missing:
            raise ValueError(f"no tokenizer for policy(ies) {', '.join(missing)}")
        self.episode_id = episode_id
        self.problem_id = problem_id
        self.env = env
        self.policy_of = dict(policy_of)
        self.tokenizers = tokenizers
        self.generate = generate
        self.k = k if mode == "train" else 1
        """Candidates per agent per turn (one request with n = k); always 1 in eval mode."""
        self.greedy = mode == "eval" if greedy is None else greedy
        self.template_kwargs = dict(template_kwargs or {})
        """policy -> extra chat-template variables (`policies.<p>.chat_template_kwargs`)."""
        """Decoding of this episode's requests (default: greedy in eval mode, sampled in training)."""
        self.alpha = float(alpha)
        self.mode = mode
        self.seed = seed
        self.turn = 0
        self.samples: list[Sample] = []
        self.committed: list[Candidate] = []
        self.rewards: dict[str, list[float]] = {}  # agent -> reward of every recorded candidate
        self.invalid: dict[str, list[bool]] = {}  # agent -> whether each recorded candidate failed to parse
        self.tokens = 0  # completion tokens generated
        self.versions: set[int] = set()
        """Weight versions that generated this episode's completions (more than one only when bounded
        staleness let a weight update land between two of its requests; one request is one version)."""
        self._groups: set[tuple[str, int]] = set()
        self._turns_played: set[int] = set()
        self.on_group = on_group
        """Called with each group's samples as it is recorded (train mode), when groups stream by turn."""
        self.streamed = 0
        """How many of `samples` (the first ones) `on_group` was given."""

    # -- the tree-sampling step -------------------------------------------------------------------

    async def act(self, node: Node) -> Candidate:
        """Sample K candidates for `node`, score each on its own clone, record the group, commit the
        best; returns the committed candidate (whose env is now `self.env`)."""
        candidates = await self.sample(node)
        self.record(node, candidates)
        chosen = self.choose(candidates)
        self.commit(chosen)
        return chosen

    async def sample(self, node: Node, n: int | None = None, greedy: bool | None = None) -> list[Candidate]:
        """`n` (default: the episode's K) candidates of `node` from ONE generate request, each scored on
        its own clone of the committed env. Records and commits nothing."""
        policy = self._policy(node.agent)
        n = self.k if n is None else n
        greedy = self.greedy if greedy is None else greedy
        obs = self.env.observe(node.agent)
        prompt_ids = chat_prompt_ids(self.tokenizers[policy], node.prompt(obs), self.template_kwargs.get(policy, {}))
        if node.max_tokens is None:
            completions = await self.generate(policy, prompt_ids, n, greedy)
        else:
            completions = await self.generate(policy, prompt_ids, n, greedy, max_tokens=node.max_tokens)
        if len(completions) != n:
            raise RuntimeError(f"generate for policy {policy!r} returned {len(completions)} completions, asked {n}")
        self._turns_played.add(self.turn)
        scoring = []
        for index, completion in enumerate(completions):
            self.tokens += len(completion.token_ids)
            self.versions.add(completion.version)
            text = self.tokenizers[policy].decode(np.asarray(completion.token_ids).tolist(), skip_special_tokens=True)
            scoring.append(self._score(node, policy, index, prompt_ids, completion, text))
        # Concurrently: an env whose `astep` runs code in the sandbox overlaps its K executions. Scarce
        # resources serve the episodes that are furthest behind first (`mas_async.api.priority`).
        episode_turn.set(self.turn)
        return list(await asyncio.gather(*scoring))

    def record(self, node: Node, candidates: list[Candidate]) -> None:
        """Keep the candidates as one group (train mode: one Sample each) and their reward statistics."""
        if not candidates:
            raise ValueError(f"record: no candidates for agent {node.agent!r}")
        turn = candidates[0].turn
        if any(c.agent != node.agent or c.turn != turn for c in candidates):
            raise ValueError(f"record: a group must hold candidates of agent {node.agent!r} at one turn")
        if (node.agent, turn) in self._groups:
            raise ValueError(
                f"record: agent {node.agent!r} already has a group at turn {turn}; "
                "call episode.next_turn() between two groups of the same agent"
            )
        self._groups.add((node.agent, turn))
        self.rewards.setdefault(node.agent, []).extend(c.reward for c in candidates)
        self.invalid.setdefault(node.agent, []).extend(not c.valid for c in candidates)
        if self.mode != "train":
            return
        group = f"{self.episode_id}/{node.agent}/{turn}"
        for c in candidates:
            self.samples.append(
                Sample(
                    group=group,
                    episode_id=self.episode_id,
                    problem_id=self.problem_id,
                    agent=c.agent,
                    policy=c.policy,
                    turn=turn,
                    prompt_ids=c.prompt_ids,
                    completion_ids=np.asarray(c.completion.token_ids, dtype=np.int32),
                    logprobs=np.asarray(c.completion.logprobs, dtype=np.float32),
                    version=c.completion.version,
                    reward=c.reward,
                    valid=c.valid,
                    info={"index": c.index, "error": c.error} if c.error else {"index": c.index},
                )
            )
        if self.on_group is not None:
            group, self.streamed = self.samples[self.streamed :], len(self.samples)
            self.on_group(group)

    def choose(self, candidates: list[Candidate]) -> Candidate:
        """The best candidate by reward; ties are broken by an RNG seeded with (seed, episode, agent,
        turn), so a rerun chooses the same branch and the choice is not biased to the first index."""
        best = max(c.reward for c in candidates)
        ties = [c for c in candidates if math.isclose(c.reward, best, rel_tol=0.0, abs_tol=1e-9)]
        if len(ties) == 1:
            return ties[0]
        first = candidates[0]
        rng = random.Random(f"{self.seed}/{self.episode_id}/{first.agent}/{first.turn}")
        return ties[rng.randrange(len(ties))]

    def commit(self, candidate: Candidate) -> None:
        """Continue the episode from `candidate`'s branch: its own clone becomes the committed env."""
        self.env = candidate.env
        self.committed.append(candidate)

    def next_turn(self) -> None:
        """Advance the turn counter (group keys are per agent and turn)."""
        self.turn += 1

    # -- the end ----------------------------------------------------------------------------------

    @property
    def episode_return(self) -> float:
        """alpha * the final team reward + the local rewards of the committed candidates."""
        return self.alpha * self.env.team_reward() + sum(c.local_reward for c in self.committed)

    def finish(self) -> dict[str, Any]:
        """Stamp every sample with the episode return; return the episode's metrics."""
        episode_return = self.episode_return
        for sample in self.samples:
            sample.episode_return = episode_return
        summary: dict[str, Any] = {"success": bool(self.env.success())}
        for agent, rewards in self.rewards.items():
            summary[f"reward/{agent}"] = float(np.mean(rewards))
        for agent, invalid in self.invalid.items():
            summary[Keys.invalid_rate(agent)] = float(np.mean(invalid))
        judged: dict[str, list[bool]] = {}
        for candidate in self.committed:
            if candidate.quality is not None:
                judged.setdefault(candidate.agent, []).append(candidate.quality)
        for agent, qualities in judged.items():
            summary[Keys.progress_rate(agent)] = float(np.mean(qualities))
        summary["turns"] = len(self._turns_played)
        summary["tokens"] = self.tokens
        summary["multi_version_tokens"] = self.tokens if len(self.versions) > 1 else 0
        return summary

    # -- helpers ----------------------------------------------------------------------------------

    def _policy(self, agent: str) -> str:
        if agent not in self.policy_of:
            known = ", ".join(sorted(self.policy_of)) or "(none)"
            raise ValueError(f"no policy serves agent {agent!r}: policy_of maps {known}")
        return self.policy_of[agent]

    async def _score(
        self, node: Node, policy: str, index: int, prompt_ids: np.ndarray, completion: Completion, text: str
    ) -> Candidate:
        try:
            action = node.parse(text)
        except ParseError as error:
            clone = self.env.clone()
            return Candidate(
                agent=node.agent,
                policy=policy,
                turn=self.turn,
                index=index,
                prompt_ids=prompt_ids,
                completion=completion,
                text=text,
                action=None,
                valid=False,
                error=str(error),
                env=clone,
                team_reward=0.0,
                local_reward=node.invalid_penalty,
                reward=node.invalid_penalty,
                quality=self.env.move_quality(node.agent, None, clone),
            )
        return await self._score_action(node, policy, index, prompt_ids, completion, text, action)

    async def _score_action(
        self,
        node: Node,
        policy: str,
        index: int,
        prompt_ids: np.ndarray,
        completion: Completion | None,
        text: str,
        action: Any,
    ) -> Candidate:
        """`action` applied to its own clone of the committed env, and rewarded as the node rewards it."""
        clone = self.env.clone()
        await step_env(clone, node.agent, action)
        team = float(clone.team_reward())
        local = float(node.local_reward(self.env, action, clone))
        return Candidate(
            agent=node.agent,
            policy=policy,
            turn=self.turn,
            index=index,
            prompt_ids=prompt_ids,
            completion=completion,
            text=text,
            action=action,
            valid=True,
            error=None,
            env=clone,
            team_reward=team,
            local_reward=local,
            reward=self.alpha * team + local,
            quality=self.env.move_quality(node.agent, action, clone),
        )
