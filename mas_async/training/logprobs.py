"""Per-token log-probs of completions under the trainer's model (the PPO ratio's numerator, and the
recomputed "old" log-probs).

The prompts and completions are token ids exactly as the inference server produced them (no
re-tokenisation). The result must match the server's sampling log-probs for the same weights to float
precision: the logged mean absolute difference between the two is the proof of on-policy training.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from torch import nn


def completion_logprobs(
    model: nn.Module,
    prompts: list[np.ndarray],
    completions: list[np.ndarray],
    temperature: float = 1.0,
    entropies: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """log p(completion[t] | prompt, completion[:t]) at `temperature`, one float tensor [T_i] per pair.

    All sequences run as one right-padded batch; gradients flow when grad mode is enabled. An empty
    completion gives an empty tensor. When `entropies` is a list, the entropy of the full next-token
    distribution at each completion position is appended to it, one tensor [T_i] per pair.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"got {len(prompts)} prompts but {len(completions)} completions")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive to compute log-probs, got {temperature}")
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = next(model.parameters()).device
    sequences = [np.concatenate([p, c]).astype(np.int64) for p, c in zip(prompts, completions, strict=True)]
    width = max(len(s) for s in sequences)
    input_ids = torch.zeros((len(sequences), width), dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        input_ids[i, : len(seq)] = torch.from_numpy(seq)
        attention_mask[i, : len(seq)] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = torch.arange(width, device=device).expand(len(sequences), width)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).logits

    result = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        start, length = len(prompt), len(completion)
        # The logits at position t predict the token at t + 1.
        row_logits = logits[i, start - 1 : start - 1 + length].float() / temperature
        targets = input_ids[i, start : start + length]
        logp = torch.log_softmax(row_logits, dim=-1)
        result.append(logp.gather(-1, targets[:, None]).squeeze(-1))
        if entropies is not None:
            entropies.append(-(logp.exp() * logp).sum(-1))
    return result
