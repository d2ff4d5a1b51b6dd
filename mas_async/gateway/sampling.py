"""What a request may ask of the sampler, and how a returned choice is cut at a stop string.

Sampling follows the run, so that a training sample is on-policy: in training, `temperature` must be
left out or equal `rollout.temperature` (the trainer recomputes log-probs at it), `top_p` left out or 1,
and `max_tokens` at most `rollout.max_tokens` (also the default); `n` is at most `algorithm.k` (and 1 for
a training call under tree sampling, whose K candidates the gateway samples itself: `tree.py`). In
evaluation a request may lower the temperature (0: greedy; left out: greedy when `eval.greedy`). `stop`
strings end a choice at the token that completes the first of them: its ids stop there, its content stops
before the string (and so do the alternatives of `top_logprobs`). `seed` makes a request reproducible:
choice i is drawn from a generator seeded with seed + i (vLLM's rule), on whatever replica and in
whatever batch it runs, so the same prompt, seed and sampling fields give the same choices (the same
weights assumed: a request of a later weight version samples another policy). `top_logprobs` (chat's,
or the legacy `logprobs` integer) asks the inference server for each sampled token's k most likely
alternatives under the distribution the token was sampled from, log_softmax(logits / temperature) (vLLM's
processed log-probs; top_p is 1 here, so nothing is cut from it), the same one as its log-prob. Both
routes (chat and text completions) follow these rules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mas_async.gateway.errors import bad_request
from mas_async.gateway.tree import TreeSampling

if TYPE_CHECKING:
    from mas_async.gateway.requests import Sampling
    from mas_async.wire.samples import Completion


@dataclass(frozen=True)
class Limits:
    """What a request may ask (from the run's config: `Limits.of`)."""

    max_n: int
    max_tokens: int
    temperature: float
    eval_greedy: bool
    max_calls: int
    max_request_bytes: int
    tree: TreeSampling | None = None
    """Tree sampling of training calls (algorithm.sampling=tree with a workflow.scorer, `tree.py`); None: each
    call samples the n choices it asks."""

    @classmethod
    def of(cls, config: Any) -> Limits:
        return cls(
            max_n=config.algorithm.k,
            max_tokens=config.rollout.max_tokens,
            temperature=config.rollout.temperature,
            eval_greedy=config.eval.greedy,
            max_calls=config.gateway.max_calls_per_episode,
            max_request_bytes=config.gateway.max_request_bytes,
            tree=TreeSampling.of(config),
        )

    def settings(self, mode: str) -> RunSampling:
        """The sampling settings of an episode of `mode` ("train" or "eval"), as its program reads them."""
        greedy = mode != "train" and self.eval_greedy
        return RunSampling(0.0 if greedy else self.temperature, self.max_tokens, self.max_n)


@dataclass(frozen=True, slots=True)
class RunSampling:
    """The run's sampling settings as a workflow program reads them (`Task.sampling`), so that it can ask
    exactly what the run trains on instead of copying the config."""

    temperature: float
    """What the episode's calls sample at: rollout.temperature in training; in evaluation 0.0 (greedy) when
    eval.greedy, else rollout.temperature. Leaving `temperature` out of a call gives the same."""
    max_tokens: int
    """rollout.max_tokens: the most (and the default) tokens of a reply."""
    k: int
    """algorithm.k: the most choices (`n`) one call may ask; under tree sampling each training call is K
    candidates that the gateway samples itself (ask one)."""
    top_p: float = 1.0
    """A run samples the full distribution."""


@dataclass(frozen=True)
class Decoding:
    """How the inference server is asked to sample a request."""

    greedy: bool
    temperature: float
    max_tokens: int
    seed: int | None = None
    top_logprobs: int = 0


def decoding(sampling: Sampling, mode: str, lim: Limits) -> Decoding:
    """The decoding of a request in an episode of `mode` ("train" or "eval"), or a 400 naming the field."""
    if sampling.n > lim.max_n:
        raise bad_request(f"n={sampling.n} is above this run's K (algorithm.k={lim.max_n})", param="n")
    max_tokens = lim.max_tokens if sampling.max_tokens is None else sampling.max_tokens
    if max_tokens > lim.max_tokens:
        raise bad_request(
            f"max_tokens={max_tokens} is above this run's rollout.max_tokens={lim.max_tokens}", param="max_tokens"
        )
    if sampling.top_p is not None and sampling.top_p != 1.0:
        raise bad_request(
            f"top_p={sampling.top_p}: this run samples the full distribution (the log-probs it trains on ignore a "
            "nucleus cut); leave top_p out or set it to 1",
            param="top_p",
        )
    temperature = sampling.temperature
    asked = (sampling.seed, sampling.top_logprobs if sampling.logprobs else 0)
    if mode == "train":
        if temperature is not None and temperature != lim.temperature:
            raise bad_request(
                f"temperature={temperature}: this run trains at rollout.temperature={lim.temperature} (the "
                "trainer recomputes log-probs at it, so a sample at another temperature would be off-policy); "
                "leave temperature out",
                param="temperature",
            )
        return Decoding(False, lim.temperature, max_tokens, *asked)
    if temperature is None:
        return Decoding(lim.eval_greedy, lim.temperature, max_tokens, *asked)
    if temperature > lim.temperature:
        raise bad_request(
            f"temperature={temperature} is above this run's rollout.temperature={lim.temperature}",
            param="temperature",
        )
    return Decoding(temperature == 0.0, temperature or lim.temperature, max_tokens, *asked)


def apply_stop(tokenizer: Any, completion: Completion, stops: list[str] | None) -> tuple[Completion, str]:
    """The completion cut at the token that completes the first stop string, and its text (before it)."""
    ids = np.asarray(completion.token_ids).tolist()
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not stops or not any(s in text for s in stops):
        return completion, text
    for end in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:end], skip_special_tokens=True)
        hits = [i for i in (prefix.find(s) for s in stops) if i >= 0]
        if hits:
            top = completion.top_ids is not None and completion.top_logprobs is not None
            cut = dataclasses.replace(
                completion,
                token_ids=np.asarray(completion.token_ids[:end]),
                logprobs=np.asarray(completion.logprobs[:end]),
                finish_reason="stop",
                top_ids=completion.top_ids[:end] if top else None,
                top_logprobs=completion.top_logprobs[:end] if top else None,
            )
            return cut, prefix[: min(hits)]
    return completion, text  # unreachable: the whole text holds a stop string
