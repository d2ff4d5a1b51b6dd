"""What prompts of token ids have in common, so that a model reads it once: the trainer's log-prob passes
(`mas_async.training.logprobs`) and the hf backend's prefill (`mas_async.inference.backends.hf`).

A tree group's K candidates share their whole prompt, and the prompts of one node share its system
message and worked examples: on SmolLM2's Plan-Path movers, 110 of 142 tokens.
"""

from __future__ import annotations

import numpy as np

MIN_SHARED_PREFIX = 8
"""Shortest common first part of the prompts worth a pass of its own (a shorter one costs a call more
than it saves)."""


def common_prefix_length(prompts: list[np.ndarray]) -> int:
    """Tokens that every prompt starts with, short of each one's last token (which must run on its own:
    its logits predict the first completion token)."""
    first, length = prompts[0], min(len(p) for p in prompts) - 1
    for prompt in prompts[1:]:
        differs = np.flatnonzero(prompt[:length] != first[:length])
        if len(differs):
            length = int(differs[0])
    return max(length, 0)


def prompt_owners(prompts: list[np.ndarray]) -> list[int]:
    """For each prompt, the index of its distinct prompt (in order of first appearance)."""
    index: dict[tuple[str, bytes], int] = {}
    return [index.setdefault((p.dtype.str, p.tobytes()), len(index)) for p in prompts]
