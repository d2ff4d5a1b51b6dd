"""How a mini-batch is cut into micro-batches for gradient accumulation (and for log-prob recomputes).

A micro-batch holds at most `trainer.micro_batch_sequences` sequences and, when
`trainer.max_tokens_per_micro_batch` is set, at most that many tokens (prompt + completion of each
sequence), so a large iteration never needs one huge forward. A sequence longer than the budget is a
micro-batch of its own. The cut changes no update: the loss normaliser is the mini-batch's global
count (training/loss.py), so the micro-batch gradients sum to the full batch's, up to float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence


def micro_batches(lengths: Sequence[int], max_sequences: int, max_tokens: int | None = None) -> list[list[int]]:
    """Consecutive index runs over `lengths` (tokens per sequence, in order), each within both limits."""
    if max_sequences < 1:
        raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i, length in enumerate(lengths):
        full = len(current) >= max_sequences or (max_tokens is not None and tokens + length > max_tokens)
        if current and full:
            out.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += length
    if current:
        out.append(current)
    return out
