"""The generation request every inference backend takes (the server builds one per Generate message)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class GenerationRequest:
    """One prompt to sample n continuations from.

    prompt_ids: int32[P], the tokenised prompt (chat template already applied).
    n: number of independent samples (the K candidates of a tree-sampling step).
    max_tokens: most tokens generated per sample.
    temperature, top_p: sampling parameters; log-probs are reported at this temperature and ignore
    top_p (keep top_p = 1.0 for on-policy training).
    greedy: take the argmax instead of sampling (temperature 0 means the same).
    stop_token_ids: a sample ends after generating any of these; the stop token is part of its ids.
    seed: None (draw from the backend's own generator), or sample i of the n draws from a generator of its
    own seeded with seed + i (vLLM's rule for n > 1): the same request gives the same samples whatever else
    is in the batch (up to float differences that padding may cause, which flip a draw only at a tie).
    top_logprobs: k > 0 returns, at each position, the k most likely tokens and their log-probs under the
    distribution the log-probs are reported in (`Completion.top_ids`, `top_logprobs`); 0 computes nothing.
    """

    prompt_ids: np.ndarray
    n: int = 1
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    top_logprobs: int = 0

    def check(self, index: int, max_positions: int) -> None:
        """Raise a ValueError naming request `index` and the problem, for every backend alike."""
        where = f"generation request {index}"
        if len(self.prompt_ids) == 0:
            raise ValueError(f"{where}: prompt_ids is empty")
        if self.n < 1 or self.max_tokens < 1:
            raise ValueError(f"{where}: n and max_tokens must be at least 1 (n={self.n}, max_tokens={self.max_tokens})")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"{where}: need temperature >= 0 and 0 < top_p <= 1 (got {self.temperature}, {self.top_p})"
            )
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"{where}: seed must be at least 0 (got {self.seed})")
        if self.top_logprobs < 0:
            raise ValueError(f"{where}: top_logprobs must be at least 0 (got {self.top_logprobs})")
        if len(self.prompt_ids) + self.max_tokens > max_positions:
            raise ValueError(
                f"{where}: prompt ({len(self.prompt_ids)} tokens) + max_tokens ({self.max_tokens}) "
                f"exceeds the model's {max_positions} positions"
            )
