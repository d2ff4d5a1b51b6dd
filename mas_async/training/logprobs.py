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

from mas_async.prefixes import MIN_SHARED_PREFIX, common_prefix_length, prompt_owners

if TYPE_CHECKING:
    from torch import nn


def completion_logprobs(
    model: nn.Module,
    prompts: list[np.ndarray],
    completions: list[np.ndarray],
    temperature: float = 1.0,
    entropies: list[torch.Tensor] | None = None,
    share_prompts: bool = True,
) -> list[torch.Tensor]:
    """log p(completion[t] | prompt, completion[:t]) at `temperature`, one float tensor [T_i] per pair.

    Gradients flow when grad mode is enabled. An empty completion gives an empty tensor. When
    `entropies` is a list, the entropy of the full next-token distribution at each completion position
    is appended to it, one tensor [T_i] per pair. With `share_prompts`, completions that share a prompt
    (a tree group's K candidates) share one pass over it, and prompts that share a first part (a node's
    system message and worked examples) one pass over that part (`_shared_prompt_logits`); otherwise all
    sequences run as one right-padded batch (`_batch_logits`).
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
    owners = prompt_owners(prompts)
    repeated = max(owners) + 1 < len(prompts)
    shared = (
        share_prompts and (repeated or common_prefix_length(prompts) >= MIN_SHARED_PREFIX)
        and any(len(c) for c in completions) and not _checkpointing(model)
    )  # fmt: skip
    if shared:
        rows, targets = _shared_prompt_logits(model, prompts, completions, owners, device)
    else:
        rows, targets = _batch_logits(model, prompts, completions, device)
    result = []
    for row_logits, target in zip(rows, targets, strict=True):
        logp = torch.log_softmax(row_logits.float() / temperature, dim=-1)
        result.append(logp.gather(-1, target[:, None]).squeeze(-1))
        if entropies is not None:
            entropies.append(-(logp.exp() * logp).sum(-1))
    return result


def _batch_logits(model, prompts, completions, device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each pair's logits predicting its completion tokens [T_i, V], and those tokens [T_i], from one
    right-padded batch of whole sequences."""
    sequences = [np.concatenate([p, c]).astype(np.int64) for p, c in zip(prompts, completions, strict=True)]
    width = max(len(s) for s in sequences)
    input_ids = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        input_ids[i, : len(seq)] = torch.from_numpy(seq)
    input_ids = input_ids.to(device)
    position_ids = torch.arange(width, device=device).expand(len(sequences), width)
    # Logits only from the first position that predicts a completion token (the LM head over every
    # prompt position would cost [B, width, vocab] floats for nothing).
    first = min(len(p) for p in prompts) - 1
    # No attention mask: the padding is on the right and attention is causal, so no real position ever
    # attends to a pad and the real positions' logits are those of a masked batch (bit for bit on CPU);
    # without a mask the attention takes its fused causal kernel (~1.9x faster forward + backward).
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=width - first).logits
    rows, targets = [], []
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        start, length = len(prompt) - first, len(completion)
        # The logits at position t predict the token at t + 1.
        rows.append(logits[i, start - 1 : start - 1 + length])
        targets.append(input_ids[i, len(prompt) : len(prompt) + length])
    return rows, targets


def _shared_prompt_logits(model, prompts, completions, owners, device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """As `_batch_logits`, computing each distinct prompt once: a causal pass over the distinct prompts
    (right-padded, its key/value cache kept with gradients), then the completions as one batch attending
    to their own prompt's cache and their own earlier tokens. For K candidates of prompts P long with
    completions C long, attention costs about P^2 + K(PC + C^2) instead of K(P + C)^2."""
    from transformers import DynamicCache

    # The prompts' pass runs on the module itself: under DDP one wrapped forward (the completions') per
    # backward, as DDP documents; the gradients through the shared cache reach every parameter anyway.
    inner = getattr(model, "module", model)
    distinct = [prompts[owners.index(u)] for u in range(max(owners) + 1)]
    lengths = [len(p) for p in distinct]
    p_width = max(lengths)
    cache = DynamicCache(config=inner.config)
    # The distinct prompts' common first part (at least one token of each is left to run on its own):
    # one pass over it, its cache repeated for every distinct prompt, then the rest of each prompt.
    shared = common_prefix_length(distinct) if len(distinct) > 1 else 0
    shared = shared if shared >= MIN_SHARED_PREFIX else 0
    if shared:
        prefix = torch.from_numpy(distinct[0][:shared].astype(np.int64))[None].to(device)
        inner(input_ids=prefix, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.batch_select_indices(torch.zeros(len(distinct), dtype=torch.long, device=device))
    prompt_ids = torch.zeros((len(distinct), p_width - shared), dtype=torch.long)
    for u, prompt in enumerate(distinct):
        prompt_ids[u, : len(prompt) - shared] = torch.from_numpy(prompt[shared:].astype(np.int64))
    prompt_ids = prompt_ids.to(device)
    last = sorted(set(n - 1 for n in lengths))  # the positions predicting the first completion tokens
    prompt_logits = inner(
        input_ids=prompt_ids,
        position_ids=torch.arange(shared, p_width, device=device).expand_as(prompt_ids),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=torch.tensor([n - shared for n in last], device=device),
    ).logits  # [U, len(last), V]
    cache.batch_select_indices(torch.tensor(owners, device=device))  # each completion's own prompt
    c_width = max(len(c) for c in completions)
    completion_ids = torch.zeros((len(completions), c_width), dtype=torch.long)
    for i, completion in enumerate(completions):
        completion_ids[i, : len(completion)] = torch.from_numpy(completion.astype(np.int64))
    completion_ids = completion_ids.to(device)
    starts = torch.tensor([lengths[u] for u in owners], device=device)
    mask = _completion_mask(starts, p_width, c_width, _attention_dtype(inner, device))
    logits = model(
        input_ids=completion_ids,
        position_ids=starts[:, None] + torch.arange(c_width, device=device)[None, :],
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
    ).logits  # [N, c_width, V]
    rows, targets = [], []
    for i, completion in enumerate(completions):
        length = len(completion)
        first = prompt_logits[owners[i], last.index(lengths[owners[i]] - 1)][None]
        rows.append(torch.cat([first, logits[i, : max(length - 1, 0)]])[:length])
        targets.append(completion_ids[i, :length])
    return rows, targets


def _completion_mask(starts: torch.Tensor, p_width: int, c_width: int, dtype: torch.dtype) -> torch.Tensor:
    """The completions' attention mask [N, 1, c_width, p_width + c_width], additive (0 = attend, -inf =
    hidden): completion token t of row i sees its prompt's real positions (below `starts[i]`; the
    cache's padding and the other rows are hidden) and its own tokens up to t. Given as the additive
    mask rather than booleans, which the attention would convert again in every layer."""
    n, device, hidden = len(starts), starts.device, float("-inf")
    prompt = torch.zeros((n, 1, 1, p_width), dtype=dtype, device=device)
    prompt.masked_fill_(torch.arange(p_width, device=device) >= starts[:, None, None, None], hidden)
    own = torch.zeros((c_width, c_width), dtype=dtype, device=device)
    own.masked_fill_(torch.ones((c_width, c_width), dtype=torch.bool, device=device).triu_(1), hidden)
    return torch.cat([prompt.expand(n, 1, c_width, p_width), own.expand(n, 1, c_width, c_width)], dim=-1)


def _attention_dtype(model: nn.Module, device: torch.device) -> torch.dtype:
    """The dtype of the attention's queries: autocast's when it is on, else the model's."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return next(model.parameters()).dtype


def _checkpointing(model: nn.Module) -> bool:
    """Activation checkpointing turns transformers' key/value cache off, so prompts cannot be shared."""
    return bool(getattr(getattr(model, "module", model), "is_gradient_checkpointing", False))
