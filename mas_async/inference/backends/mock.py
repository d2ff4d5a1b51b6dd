"""The mock inference engine: synthetic tokens at a set rate, for overhead benchmarks and fast tests.

`MockEngine` is a synchronous engine for `ThreadedBackend` (like the transformers one) that runs no
model: each batch sleeps for the time a batched decoder would take, then returns random token ids with
a uniform log-prob (sample i of a request with a `seed` draws from a generator seeded with seed + i, so
it repeats; a request asking for k alternatives gets the sampled id and the k - 1 ids after it, each with
the same uniform log-prob, since every id of a uniform distribution is as likely). It never stops
early (stop tokens are never drawn), so every completion has exactly `max_tokens` tokens and a
workload's token count is known in advance. Never use it for training: its tokens carry no information
and it accepts any weight broadcast (`parameter_manifest()` is None and `load_weights` does nothing but
the version still advances).

Its speed models a memory-bound batched decoder (the regime of LLM decoding on a GPU): one batch of B
sequences generating T tokens takes `T * (step_s + B * token_s)` seconds, and batches larger than
`max_batch_sequences` run as several batches one after another. Set it with environment variables
(read at construction, so a benchmark sets them before starting the inference servers):

    MAS_ASYNC_MOCK_STEP_MS    time of one decode step of a whole batch, in ms (default 0)
    MAS_ASYNC_MOCK_TOKEN_MS   extra time per sequence per step, in ms (default 0)
    MAS_ASYNC_MOCK_MAX_BATCH  most sequences in one batch (default 512)

For example STEP_MS=10 is a ~1.7B model on one GPU at ~100 tokens/s per sequence. Token ids are drawn
below the model's vocabulary size (config.json's `vocab_size`, capped by the tokenizer's own vocabulary
when model_path has a tokenizer.json), so an env worker can decode them.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from mas_async.wire.samples import Completion

if TYPE_CHECKING:
    import torch

    from mas_async.inference.request import GenerationRequest

DEFAULT_VOCAB = 32_000
"""Token ids are drawn below this when model_path says nothing about its vocabulary."""


@dataclass(frozen=True)
class MockSpeed:
    """How fast the mock decodes (see the module docstring for the time model)."""

    step_s: float = 0.0
    """Seconds per decode step of one batch, whatever its size."""
    token_s: float = 0.0
    """Extra seconds per sequence per decode step."""
    max_batch_sequences: int = 512
    """Most sequences in one batch; more run as consecutive batches."""

    def __post_init__(self) -> None:
        if self.step_s < 0 or self.token_s < 0 or self.max_batch_sequences < 1:
            raise ValueError(f"mock speed must have step_s, token_s >= 0 and max_batch_sequences >= 1, got {self}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> MockSpeed:
        """Read MAS_ASYNC_MOCK_STEP_MS, MAS_ASYNC_MOCK_TOKEN_MS and MAS_ASYNC_MOCK_MAX_BATCH."""
        env = os.environ if environ is None else environ

        def number(name: str, default: str) -> float:
            raw = env.get(name, default)
            try:
                return float(raw)
            except ValueError:
                raise ValueError(f"{name} must be a number, got {raw!r}") from None

        return cls(
            step_s=number("MAS_ASYNC_MOCK_STEP_MS", "0") / 1000,
            token_s=number("MAS_ASYNC_MOCK_TOKEN_MS", "0") / 1000,
            max_batch_sequences=int(number("MAS_ASYNC_MOCK_MAX_BATCH", "512")),
        )

    def to_env(self) -> dict[str, str]:
        """The environment variables that reproduce this speed in another process."""
        return {
            "MAS_ASYNC_MOCK_STEP_MS": repr(self.step_s * 1000),
            "MAS_ASYNC_MOCK_TOKEN_MS": repr(self.token_s * 1000),
            "MAS_ASYNC_MOCK_MAX_BATCH": str(self.max_batch_sequences),
        }

    def batch_seconds(self, sequences: int, steps: int) -> float:
        """Time to decode `steps` tokens for `sequences` sequences (split at the batch limit)."""
        full, rest = divmod(sequences, self.max_batch_sequences)
        sizes = [self.max_batch_sequences] * full + ([rest] if rest else [])
        return sum(steps * (self.step_s + size * self.token_s) for size in sizes)


def vocab_size(model_path: str | Path) -> int:
    """Number of token ids the model at `model_path` can decode (DEFAULT_VOCAB if it does not say)."""
    folder = Path(model_path)
    size = DEFAULT_VOCAB
    config = folder / "config.json"
    if config.is_file():
        size = int(json.loads(config.read_text()).get("vocab_size", size))
    tokenizer = folder / "tokenizer.json"
    if tokenizer.is_file():
        # A hub model pads its embedding beyond the tokenizer's ids; those cannot be decoded.
        from tokenizers import Tokenizer

        size = min(size, Tokenizer.from_file(str(tokenizer)).get_vocab_size(with_added_tokens=True))
    return size


class MockEngine:
    """Synthetic completions at the speed of `MockSpeed` (from the environment unless given)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        seed: int = 0,
        speed: MockSpeed | None = None,
        dtype: str = "float32",
        max_batch_sequences: int = 512,
    ) -> None:
        # dtype and max_batch_sequences: the backend constructor's common arguments; no model runs here.
        self.speed = MockSpeed.from_env() if speed is None else speed
        self.vocab_size = vocab_size(model_path)
        self.rng = np.random.default_rng(seed)
        self.version: int = 0
        self.batches = 0
        """Batches generated so far (each request list may make several, at the batch limit)."""

    def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        """n completions of exactly max_tokens tokens for each request, after the modelled delay."""
        if not requests:
            return []
        sequences = sum(r.n for r in requests)
        steps = max(r.max_tokens for r in requests)
        start = time.perf_counter()
        results = [self._completions(r) for r in requests]
        delay = self.speed.batch_seconds(sequences, steps) - (time.perf_counter() - start)
        if delay > 0:
            time.sleep(delay)
        self.batches += math.ceil(sequences / self.speed.max_batch_sequences)
        return results

    def _completions(self, request: GenerationRequest) -> list[Completion]:
        if request.n < 1 or request.max_tokens < 1:
            raise ValueError(
                f"mock generate: n and max_tokens must be at least 1, got {request.n}, {request.max_tokens}"
            )
        stops = np.asarray(sorted(set(request.stop_token_ids)), dtype=np.int64)
        if len(stops) >= self.vocab_size:
            raise ValueError("mock generate: every token id of the vocabulary is a stop token")
        if request.seed is None:
            tokens = self._tokens(self.rng, (request.n, request.max_tokens), stops)
        else:
            rngs = [np.random.default_rng(request.seed + i) for i in range(request.n)]
            tokens = np.stack([self._tokens(rng, (request.max_tokens,), stops) for rng in rngs])
        logprob = -math.log(self.vocab_size)
        k = min(request.top_logprobs, self.vocab_size)
        return [
            Completion(
                token_ids=row,
                logprobs=np.full(request.max_tokens, logprob, dtype=np.float32),
                version=self.version,
                finish_reason="length",
                top_ids=((row[:, None] + np.arange(k)) % self.vocab_size).astype(np.int32) if k else None,
                top_logprobs=np.full((request.max_tokens, k), logprob, dtype=np.float32) if k else None,
            )
            for row in tokens
        ]

    def _tokens(self, rng: np.random.Generator, shape: tuple[int, ...], stops: np.ndarray) -> np.ndarray:
        """Token ids of `shape` drawn from `rng`, none of them a stop id."""
        tokens = rng.integers(0, self.vocab_size, size=shape, dtype=np.int32)
        redraw = np.isin(tokens, stops)
        while redraw.any():  # never stop early: every completion has exactly max_tokens tokens
            tokens[redraw] = rng.integers(0, self.vocab_size, size=int(redraw.sum()), dtype=np.int32)
            redraw = np.isin(tokens, stops)
        return tokens

    def parameter_manifest(self) -> None:
        """None: the mock accepts a broadcast of any tensors."""
        return None

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Nothing to load (the ThreadedBackend still advances `version`)."""
