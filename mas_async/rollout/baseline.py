"""The baseline episode: one of the env's reference policies plays through the run's own workflow.

`Env.reference_policies()` names fixed policies (uniform random moves, a constant answer, the env's own
heuristic or solver). To know what a trained policy's held-out figures are worth, the run plays each
of them on the same held-out problems as `eval`, through the same workflow, the same nodes' local
rewards and the same team reward: a `BaselineEpisode` is an `Episode` whose `sample` asks the
reference policy for each candidate's action instead of generating a reply, then scores it on its own
clone exactly as a parsed candidate is scored (`Episode._score_action`). Nothing is generated, so no
request leaves the env worker, and nothing is recorded for training (its mode is "baseline/<name>",
never "train"). The router dispatches these episodes beside the run's first evaluation and reports
them as `eval/baseline/<name>/...` (router/report.py).

A baseline episode's summary is the policy's expectation on its problem, not one draw
(`ExpectedBaselines`): its success is a probability. Where every random choice of the policy goes
through `rng`'s integer draws (`choice`, `randrange`, `randint`, `shuffle`, `sample`) and there are at
most `EXACT_PATHS` sequences of choices, each sequence is played once and weighted by its probability:
the figure is exact (a policy without randomness is one sequence). Otherwise (a policy that calls
`rng.random()`, or too many sequences) it is the mean of enough seeded draws that the figure over the
held-out problems has a standard error of at most `eval.baseline_standard_error`, 0.005 by default
(`draws_per_episode`). Both rest on
the env being deterministic given its problem and the actions, which `check_env` checks.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from mas_async.api.env import problem_content
from mas_async.rollout.episode import BASELINE_PREFIX, Episode

if TYPE_CHECKING:
    from mas_async.api.env import Env, ReferencePolicy
    from mas_async.api.node import Node
    from mas_async.api.workflow import Candidate
    from mas_async.config import Config

NO_PROMPT = np.zeros(0, dtype=np.int32)


class UnknownBaseline(ValueError):
    """A baseline episode names a reference policy that its env does not have."""


def baseline_mode(name: str) -> str:
    """The episode mode of reference policy `name`: "baseline/<name>"."""
    return BASELINE_PREFIX + name


def baseline_name(mode: str) -> str | None:
    """The reference policy of a "baseline/<name>" mode; None for any other mode."""
    return mode[len(BASELINE_PREFIX) :] if mode.startswith(BASELINE_PREFIX) else None


def check_baseline_names(env_name: str, names: list[str]) -> list[str]:
    """`names` (an env's reference policies) if each can name a mode and a metric, else a ValueError."""
    bad = [n for n in names if not isinstance(n, str) or not n or "/" in n or any(ch.isspace() for ch in n)]
    if bad:
        raise ValueError(
            f"env {env_name!r}: reference policy names must be non-empty strings without '/' or spaces, got {bad[0]!r}"
        )
    return names


class BaselineEpisode(Episode):
    """An episode in which the env's reference policy `name` chooses every action (see the module docstring).

    `rng` is the policy's only source of randomness: seeded per episode, a rerun plays the same moves."""

    def __init__(
        self,
        *,
        name: str,
        policies: Mapping[str, ReferencePolicy],
        rng: random.Random,
        episode_id: str,
        problem_id: str,
        env: Env,
        policy_of: dict[str, str],
        alpha: float,
        seed: int = 0,
    ) -> None:
        if name not in policies:
            known = ", ".join(sorted(policies)) or "(none)"
            raise UnknownBaseline(f"{type(env).__name__} has no reference policy {name!r}: it has {known}")
        super().__init__(
            episode_id=episode_id,
            problem_id=problem_id,
            env=env,
            policy_of=policy_of,
            tokenizers=dict.fromkeys(policy_of.values()),
            generate=_no_generate,
            k=1,
            alpha=alpha,
            mode=baseline_mode(name),
            seed=seed,
            greedy=True,
        )
        self.name = name
        self.reference = policies[name]
        self.rng = rng

    async def sample(self, node: Node, n: int | None = None, greedy: bool | None = None) -> list[Candidate]:
        """`n` (default 1) candidates of `node`, each an action of the reference policy in the committed
        state, scored on its own clone as a parsed candidate is."""
        policy = self._policy(node.agent)
        n = self.k if n is None else n
        self._turns_played.add(self.turn)
        candidates = []
        for index in range(n):
            action = self.reference(self.env, node.agent, self.rng)
            text = f"[{self.name}] {action!r}"
            candidates.append(await self._score_action(node, policy, index, NO_PROMPT, None, text, action))
        return candidates

    def finish(self) -> dict[str, Any]:
        """The episode's metrics, without a parse-failure rate: no reply was parsed."""
        self.invalid.clear()
        return super().finish()


async def _no_generate(policy: str, prompt_ids: Any, n: int, greedy: bool) -> list:
    raise AssertionError("a baseline episode never generates")  # internal invariant: sample() is overridden


# -- a reference policy's expectation on one problem -----------------------------------------------

EXACT_PATHS = 4096
"""Sequences of a reference policy's random choices enumerated on one problem, at most, for its exact
expectation, in an env that runs no program (a play costs about a millisecond); past that, draws
(`draws_per_episode`). An env that runs programs enumerates no more sequences than it would draw
(`exact_paths`)."""
PROBES = 8
"""Random sequences of choices played first to estimate how many there are (`estimate_paths`)."""
KEPT = 4096
"""Problems whose summary (or that it could not be enumerated) an env worker keeps per policy: the draws
the router plans of one problem (`eval.baseline_draws`) share one enumeration."""

Summary = dict[str, Any]
PlayOnce = Callable[[random.Random], Awaitable[Summary]]
"""Plays one baseline episode of the problem from its start with the given `rng`; returns `finish()`."""


class NotEnumerable(Exception):
    """The policy drew from `rng` otherwise than by an integer below a bound: its choices cannot be listed."""


class ScriptedRandom(random.Random):
    """A `random.Random` whose integer draws (every `choice`, `randrange`, `randint`, `shuffle` and `sample`
    comes down to `_randbelow(n)`) follow `script`, and past its end `chooser`'s uniform draws (0 without
    one); `widths` records each draw's n. A draw of one possible value is no choice and is not recorded. Any
    other draw (`random()`, `getrandbits`, so `choices`, `uniform`, `gauss`) raises `NotEnumerable`."""

    def __init__(self, script: list[int], chooser: random.Random | None = None) -> None:
        super().__init__(0)
        self.script = list(script)
        self.chooser = chooser
        self.widths: list[int] = []

    def _randbelow(self, n: int) -> int:
        if n <= 1:
            return 0
        index = len(self.widths)
        self.widths.append(n)
        if index == len(self.script):
            self.script.append(0 if self.chooser is None else self.chooser.randrange(n))
        return self.script[index]

    def random(self) -> float:
        raise NotEnumerable("the policy called rng.random()")

    def getrandbits(self, k: int) -> int:
        raise NotEnumerable("the policy called rng.getrandbits()")


def _next_script(script: list[int], widths: list[int]) -> list[int] | None:
    """The next sequence of choices in depth-first order after the one just played, None after the last."""
    for depth in range(len(widths) - 1, -1, -1):
        if script[depth] + 1 < widths[depth]:
            return script[:depth] + [script[depth] + 1]
    return None


def weighted_summary(played: list[tuple[float, Summary]]) -> Summary:
    """The expectation of each numeric key of the (weight, summary) pairs (success as a probability), each
    key over the summaries that hold it; other values from the first summary that has them."""
    numbers: dict[str, list[float]] = {}
    merged: Summary = {}
    for weight, summary in played:
        for key, value in summary.items():
            if isinstance(value, bool | int | float):
                numbers.setdefault(key, [0.0, 0.0])
                numbers[key][0] += weight * float(value)
                numbers[key][1] += weight
            else:
                merged.setdefault(key, value)
    for key, (total, weights) in numbers.items():
        merged[key] = total / weights if weights > 0 else 0.0
    return merged


async def enumerate_choices(play: PlayOnce, max_paths: int = EXACT_PATHS) -> Summary | None:
    """The exact expected summary over every sequence of the policy's choices, each played once with its
    probability; None when they are more than `max_paths` or the policy draws anything but an integer below
    a bound."""
    script: list[int] | None = []
    played: list[tuple[float, Summary]] = []
    while script is not None:
        rng = ScriptedRandom(script)
        try:
            summary = await play(rng)
        except NotEnumerable:
            return None
        played.append((math.prod(1.0 / width for width in rng.widths), summary))
        if len(played) > max_paths:
            return None
        script = _next_script(rng.script, rng.widths)
        await asyncio.sleep(0)  # a long enumeration leaves the worker's other tasks their turns
    return weighted_summary(played)


async def estimate_paths(play: PlayOnce, seed: str, probes: int = PROBES) -> float | None:
    """Knuth's estimate of how many sequences of choices the policy has on the problem: the mean, over
    `probes` sequences of uniformly drawn choices, of the product of their widths (None: the policy draws
    something else than an integer below a bound)."""
    products = []
    for probe in range(probes):
        rng = ScriptedRandom([], random.Random(f"{seed}/probe{probe}"))
        try:
            await play(rng)
        except NotEnumerable:
            return None
        products.append(math.prod(rng.widths))
    return sum(products) / len(products)


async def draw_mean(play: PlayOnce, seed: str, draws: int) -> Summary:
    """The mean summary of `draws` episodes, the d-th with `random.Random(f"{seed}/{d}")`."""
    played = []
    for draw in range(draws):
        played.append((1.0, await play(random.Random(f"{seed}/{draw}"))))
        await asyncio.sleep(0)
    return weighted_summary(played)


def draws_per_episode(config: Config) -> int:
    """Draws one baseline episode plays when its policy cannot be enumerated: enough that the success rate
    over the held-out problems (`eval.size` of them, `eval.baseline_draws` x `eval.k` episodes each) has a
    standard error of at most `eval.baseline_standard_error`, whatever each problem's success probability
    p (the error is at most sqrt(0.25 / draws per problem / problems), p(1 - p) <= 0.25)."""
    problems = min(config.eval.size, config.env.test_size)
    episodes = problems * config.eval.baseline_draws * config.eval.k
    # round() first: a whole quotient must not come out as 16.000000000000004 and cost a draw
    return max(1, math.ceil(round(0.25 / (config.eval.baseline_standard_error**2 * episodes), 9)))


def exact_paths(config: Config, env_cls: type[Env]) -> int:
    """The most sequences of choices enumerated on one problem: `EXACT_PATHS`, or in an env that runs
    programs (a sandbox run per turn and play) the plays its draws would cost on that problem."""
    if not env_cls.runs_code:
        return EXACT_PATHS
    return draws_per_episode(config) * config.eval.baseline_draws * config.eval.k


class ExpectedBaselines:
    """One env worker's baseline summaries: exact where the policy's choices can be enumerated in at most
    `max_paths` sequences (Knuth's estimate from `PROBES` random ones first, then counted), else the mean
    of `draws` seeded draws. What it found of each policy and problem content is kept, so the router's
    draws of one problem share one enumeration and no problem is tried twice."""

    def __init__(self, draws: int, max_paths: int = EXACT_PATHS) -> None:
        self.draws = draws
        self.max_paths = max_paths
        self.exact: dict[tuple[str, str], Summary] = {}
        self.too_many: set[tuple[str, str]] = set()
        """(policy, problem content) whose choices cannot be enumerated within `max_paths`."""
        self.drawn = 0
        """Summaries that were drawn, not enumerated."""

    async def summary(self, name: str, problem: dict[str, Any], seed: int, play: PlayOnce) -> Summary:
        key = (name, problem_content(problem))
        if key in self.exact:
            return dict(self.exact[key])
        if key not in self.too_many:
            exact = await self._enumerate(play, f"{seed}/{name}")
            if exact is not None:
                if len(self.exact) >= KEPT:
                    self.exact.clear()
                self.exact[key] = exact
                return dict(exact)
            if len(self.too_many) >= KEPT:
                self.too_many.clear()
            self.too_many.add(key)
        self.drawn += 1
        return await draw_mean(play, f"{seed}/{name}", self.draws)

    async def _enumerate(self, play: PlayOnce, seed: str) -> Summary | None:
        first = ScriptedRandom([])
        try:
            summary = await play(first)
        except NotEnumerable:
            return None
        if not first.widths:
            return summary  # no choice on the first sequence: it is the only one (a policy without randomness)
        estimate = await estimate_paths(play, seed)
        if estimate is None or estimate > self.max_paths:
            return None
        return await enumerate_choices(play, self.max_paths)
