"""The data that flows from rollout to training: completions from an inference server and the
training samples an episode records from them.

A `Completion` is what an inference server returns for one of the n samples of a request.
A `Sample` is one candidate of a group: the token ids are the truth (no re-tokenisation anywhere),
the reward is the candidate's own (scored on its own env clone), and `version` is the weight version
that generated it, which the trainer checks against its own (strict on-policy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class Completion:
    """One sampled continuation. token_ids: int32[T]; logprobs: float32[T] (log-prob of each sampled
    token under the sampling distribution); version: weight version of the server that produced it.

    top_ids: int32[T, k] and top_logprobs: float32[T, k], only when the request asked for k > 0
    alternatives (the gateway's `top_logprobs`): at each position the k most likely tokens of the same
    distribution the token was sampled from, most likely first (None otherwise). They are served to the
    caller and never trained on: a `Sample` takes the sampled token's log-prob only."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    version: int
    finish_reason: str = "length"
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


@dataclass(slots=True)
class Sample:
    """One candidate of one group, ready for the trainer of `policy`.

    group: the group key "<episode_id>/<agent>/<turn>" (AT-GRPO); episode ids are unique per problem
    and iteration, so keys of two problems never merge.
    problem_id: identifies the problem (for per-agent grouping across a problem's samples).
    prompt_ids: int32[P]; completion_ids: int32[T]; logprobs: float32[T] (rollout log-probs).
    """

    group: str
    episode_id: str
    problem_id: str
    agent: str
    policy: str
    turn: int
    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    logprobs: np.ndarray
    version: int
    reward: float
    valid: bool = True
    episode_return: float = 0.0
    info: dict = field(default_factory=dict)
