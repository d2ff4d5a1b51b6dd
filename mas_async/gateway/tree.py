"""Tree sampling of a workflow program's calls: K candidates of one call, the best by the program's scorer.

Under `algorithm.sampling: tree` (AT-GRPO's tree sampling) a node class's turn is K candidates of one
state, each scored on its own env clone, the best committed. A program makes its own calls and steps its
own env, so the gateway cannot score a candidate itself; the run's `workflow.scorer` does:

    async def score(task, agent, messages, choice) -> float

`task` is the episode's `Task` (the program's own: its env as the program has left it), `agent` the
call's agent, `messages` the call's messages (OpenAI's shape, as the gateway read them), `choice` one
candidate's assistant message as the program would get it (`{"role": "assistant", "content": ...}`,
and `tool_calls` when the reply holds some). A training call of the program that asks one choice (n=1,
the default) is sampled as K = `algorithm.k` candidates of its prompt in one request (n=K); the scorer
is awaited on each, all K concurrently, each in the episode's context (its sandbox priority) and within
`timeout_s`; the best candidate (the first of equal best) is the call's one choice, and only it continues
the agent's transcript (the next call's exact-token prompt is built on its ids). All K are recorded as the
group of (episode, agent, turn), each credited with its own score (`episode.py`).

A scorer that raises, returns anything but a finite number, or outruns `timeout_s` fails its episode
(`ScoreError`, reported in EpisodeDone.error and counted as dropped, as a failing program is); the call
gets a 500 and the episode's later calls are refused. Evaluation episodes are not tree-sampled.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mas_async.api.priority import episode_turn

if TYPE_CHECKING:
    from mas_async.config import Config

Scorer = Callable[..., Awaitable[Any]]
"""async def score(task: Task, agent: str, messages: list[dict], choice: dict) -> float."""
Score = Callable[[str, list[dict[str, Any]], dict[str, Any]], Awaitable[Any]]
"""The scorer bound to one episode's task: (agent, messages, choice) -> its score."""


class ScoreError(ValueError):
    """The scorer of a tree-sampled call raised, returned no finite number, or did not return in time."""


@dataclass(frozen=True, slots=True)
class TreeSampling:
    """How a program's training calls are tree-sampled (from the run's config: `TreeSampling.of`)."""

    k: int
    """Candidates per call: `algorithm.k`."""
    scorer: str
    """`workflow.scorer`, "module:function"."""
    timeout_s: float
    """How long one candidate's scoring may take: `rollout.request_timeout_s`, as one generate request."""

    @classmethod
    def of(cls, config: Config) -> TreeSampling | None:
        """The run's tree sampling of a program's calls; None under parallel sampling or without a program."""
        if config.algorithm.sampling != "tree" or config.workflow.scorer is None:
            return None
        return cls(config.algorithm.k, config.workflow.scorer, config.rollout.request_timeout_s)


async def score_candidates(
    score: Score,
    agent: str,
    messages: list[dict[str, Any]],
    candidates: list[dict[str, Any]],
    *,
    timeout_s: float,
    context: contextvars.Context,
    turn: int,
    where: str,
) -> list[float]:
    """The score of each candidate (its assistant message), all awaited concurrently, each in a copy of
    `context` at `turn` and within `timeout_s`; a ScoreError naming `where` and the candidate otherwise."""

    def scoring(choice: dict[str, Any]) -> asyncio.Task[Any]:
        own = context.copy()
        own.run(episode_turn.set, turn)  # scarce resources go first to the episodes furthest behind
        return asyncio.create_task(asyncio.wait_for(score(agent, messages, choice), timeout_s), context=own)

    results = await asyncio.gather(*(scoring(choice) for choice in candidates), return_exceptions=True)
    scores = []
    for index, result in enumerate(results):
        what = f"workflow.scorer on candidate {index} of {where}"
        if isinstance(result, TimeoutError):
            raise ScoreError(f"{what} did not return within {timeout_s:g}s (rollout.request_timeout_s)")
        if isinstance(result, BaseException):
            raise ScoreError(f"{what} raised {type(result).__name__}: {result}") from result
        if isinstance(result, bool) or not isinstance(result, (int, float)) or not math.isfinite(result):
            raise ScoreError(f"{what} returned {result!r}: a scorer returns a finite number")
        scores.append(float(result))
    return scores


def best(scores: list[float]) -> int:
    """The index of the best score, the first of equal best (the K candidates are i.i.d. draws of one
    request, so the first of a tie is as good as a random one)."""
    return max(range(len(scores)), key=lambda i: (scores[i], -i))
