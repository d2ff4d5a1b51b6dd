"""The values an inference server serves a Generate with, derived from the run's config and the model.

A Generate that decodes is well typed, not yet sane: n = 10**9, a prompt of ids past the vocabulary
(an index error in the embedding on the CPU, a device-side assert that kills the process on a GPU),
max_tokens past the model's positions, a NaN temperature. The server checks every request with
`GenerateLimits.check` when it arrives and answers one out of range with a GenerateResult whose error
names the field, so a bad request costs one reply, never a batch or the process.

The bounds: n from 1 to the larger of `algorithm.k` (the K candidates of a tree-sampling step) and the
policy's `max_batch_sequences` (one request is at most one whole batch; a workflow may ask `episode.sample`
for any n up to it); max_tokens from 1 to `rollout.max_tokens`; a non-empty integer prompt of ids below
the model's vocabulary whose length plus max_tokens fits the backend's positions; temperature from 0
(greedy) to `rollout.temperature`, what every env worker sends; 0 < top_p <= 1; stop ids ints below
the vocabulary, fewer than it has; seed NO_SEED or 0..MAX_SEED; top_logprobs 0..MAX_TOP_LOGPROBS and at
most the vocabulary. Limits the model folder does not state (no config.json) are not checked.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mas_async.wire.messages import MAX_SEED, MAX_TOP_LOGPROBS, NO_SEED

if TYPE_CHECKING:
    from mas_async.config import Config
    from mas_async.wire.messages import Generate


@dataclass(frozen=True)
class GenerateLimits:
    max_n: int
    max_tokens: int
    max_temperature: float
    max_positions: int | None
    """Prompt + completion tokens the backend takes (None: unknown)."""
    vocab_size: int | None
    """Token ids are below this (None: unknown)."""

    @classmethod
    def of(cls, config: Config, policy: str, model_path: str, backend: Any) -> GenerateLimits:
        model = _model_config(model_path)
        positions = _backend_positions(backend) or model.get("max_position_embeddings")
        vocab = model.get("vocab_size")
        return cls(
            max_n=max(config.algorithm.k, config.policies[policy].max_batch_sequences),
            max_tokens=config.rollout.max_tokens,
            max_temperature=config.rollout.temperature,
            max_positions=positions if isinstance(positions, int) else None,
            vocab_size=vocab if isinstance(vocab, int) else None,
        )

    def check(self, msg: Generate) -> str:
        """ "" when `msg` may be served, else why not, naming the field."""
        if not 1 <= msg.n <= self.max_n:
            return f"Generate.n={msg.n} is outside 1..{self.max_n}"
        if not 1 <= msg.max_tokens <= self.max_tokens:
            return f"Generate.max_tokens={msg.max_tokens} is outside 1..{self.max_tokens} (rollout.max_tokens)"
        if not (math.isfinite(msg.temperature) and 0 <= msg.temperature <= self.max_temperature):
            return f"Generate.temperature={msg.temperature} is outside 0..{self.max_temperature} (rollout.temperature)"
        if not 0 < msg.top_p <= 1:
            return f"Generate.top_p={msg.top_p} is outside (0, 1]"
        if msg.seed != NO_SEED and not 0 <= msg.seed <= MAX_SEED:
            return f"Generate.seed={msg.seed} is outside 0..{MAX_SEED} (or {NO_SEED}: none)"
        if not 0 <= msg.top_logprobs <= min(MAX_TOP_LOGPROBS, self.vocab_size or MAX_TOP_LOGPROBS):
            return f"Generate.top_logprobs={msg.top_logprobs} is outside 0..{MAX_TOP_LOGPROBS} (and the vocabulary)"
        if not all(isinstance(i, int) for i in msg.stop_token_ids):
            return "Generate.stop_token_ids holds a value that is not an int"
        prompt = msg.prompt_ids
        if prompt.ndim != 1 or len(prompt) == 0 or prompt.dtype.kind not in "iu":
            return f"Generate.prompt_ids must be a non-empty array of ints (got {prompt.dtype}{list(prompt.shape)})"
        if self.max_positions is not None and len(prompt) + msg.max_tokens > self.max_positions:
            return (
                f"Generate.prompt_ids: {len(prompt)} tokens + max_tokens {msg.max_tokens} exceed the model's "
                f"{self.max_positions} positions"
            )
        if self.vocab_size is not None:
            if prompt.min() < 0 or prompt.max() >= self.vocab_size:
                return f"Generate.prompt_ids holds ids outside 0..{self.vocab_size - 1} (the vocabulary)"
            stops = msg.stop_token_ids
            if len(set(stops)) >= self.vocab_size or any(not 0 <= i < self.vocab_size for i in stops):
                return f"Generate.stop_token_ids must be fewer than {self.vocab_size} ids below {self.vocab_size}"
        return ""


def _model_config(model_path: str) -> dict[str, Any]:
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _backend_positions(backend: Any) -> int | None:
    """The positions a backend says it takes: vLLM's max_model_len, the hf engine's max_positions."""
    for holder in (backend, getattr(backend, "engine", None)):
        for name in ("max_model_len", "max_positions"):
            value = getattr(holder, name, None)
            if isinstance(value, int):
                return value
    return None
