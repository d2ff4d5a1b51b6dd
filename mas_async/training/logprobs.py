"""Per-token log-probs of completions under the trainer's model (the PPO ratio's numerator, and the
recomputed "old" log-probs).

The prompts and completions are token ids exactly as the inference server produced them (no
re-tokenisation). The result must match the server's sampling log-probs for the same weights to float
precision: the logged mean absolute difference between the two is the proof of on-policy training.

Memory: the model is asked for its last hidden states, never for logits; the LM head runs on the
completion positions only, `chunk_positions(vocab)` of them at a time (at most `LOGITS_CHUNK_BYTES` of
float32 logits each), and with gradients each chunk is checkpointed: its backward recomputes the
chunk's logits instead of keeping them. So no [T, V] float32 tensor of a whole sample exists, in the
forward or in the backward: at Qwen3's 151,936-token vocabulary a 4,096-token sample's log-softmax
alone would be 2.5 GB. A pass whose positions fit in one chunk runs it as a plain function (no
recompute: its saved tensors are within the same bound).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from mas_async.prefixes import MIN_SHARED_PREFIX, common_prefix_length, prompt_owners

if TYPE_CHECKING:
    from torch import nn

LOGITS_CHUNK_BYTES = 128 * 2**20
"""Float32 logits the LM head computes at once: 220 positions at Qwen3's vocabulary, every position of a
pass at the tiny models' (a chunk's forward and backward hold a few tensors of this size)."""

_UNSUPPORTED_HEADS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config keys of models whose logits are more than the LM head of the last hidden state."""


def chunk_positions(vocab: int) -> int:
    """Completion positions whose logits are computed at once: `LOGITS_CHUNK_BYTES` of float32 logits."""
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab))


def completion_logprobs(
    model: nn.Module,
    prompts: list[np.ndarray],
    completions: list[np.ndarray],
    temperature: float = 1.0,
    entropies: list[torch.Tensor] | None = None,
    share_prompts: bool = True,
    chunk: int | None = None,
) -> list[torch.Tensor]:
    """log p(completion[t] | prompt, completion[:t]) at `temperature`, one float tensor [T_i] per pair.

    Gradients flow when grad mode is enabled. An empty completion gives an empty tensor. When
    `entropies` is a list, the entropy of the full next-token distribution at each completion position
    is appended to it, one tensor [T_i] per pair. With `share_prompts`, completions that share a prompt
    (a tree group's K candidates) share one pass over it, and prompts that share a first part (a node's
    system message and worked examples) one pass over that part (`_shared_prompt_hidden`); otherwise all
    sequences run as one right-padded batch (`_batch_hidden`). `chunk`: completion positions whose
    logits are computed at once (None: `chunk_positions` of the model's vocabulary).
    """
    if len(prompts) != len(completions):
        raise ValueError(f"got {len(prompts)} prompts but {len(completions)} completions")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive to compute log-probs, got {temperature}")
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    head = _output_head(model)
    device = next(model.parameters()).device
    owners = prompt_owners(prompts)
    repeated = max(owners) + 1 < len(prompts)
    # A lone pair has nothing to share: it takes the batch's fused causal attention, not the mask.
    prefix = len(prompts) > 1 and common_prefix_length(prompts) >= MIN_SHARED_PREFIX
    shared = (
        share_prompts and (repeated or prefix)
        and any(len(c) for c in completions) and not _checkpointing(model)
    )  # fmt: skip
    if shared:
        hidden, targets, order = _shared_prompt_hidden(model, prompts, completions, owners, device)
    else:
        (hidden, targets), order = _batch_hidden(model, prompts, completions, device), None
    chunk = chunk or chunk_positions(_vocab_size(head))
    logp, entropy = head_logprobs(head, hidden, targets, temperature, entropies is not None, chunk)
    sizes = [len(c) for c in completions]
    if order is not None:  # the rows came prompt passes' first, then the completion pass's: put back
        logp = logp.index_select(0, order)
        entropy = None if entropy is None else entropy.index_select(0, order)
    if entropies is not None:
        for ent in entropy.split(sizes):
            entropies.append(ent)
    return list(logp.split(sizes))


def head_logprobs(
    head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool, chunk: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) [N] under the LM `head` of `hidden` [N, H] at `temperature`, and the entropies [N]
    (None without `entropy`), `chunk` positions at a time. With gradients and more than one chunk, each
    chunk is a non-reentrant checkpoint: what its backward keeps is its slice of `hidden`, and it
    recomputes the chunk's logits when it runs; the values and gradients are those of one pass."""

    def piece(h: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = head(h).float()
        if temperature != 1.0:
            logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1)
        picked = logp.gather(-1, t[:, None]).squeeze(-1)
        return (picked, -(logp.exp() * logp).sum(-1)) if entropy else (picked,)

    recompute = torch.is_grad_enabled() and len(hidden) > chunk
    parts = []
    for start in range(0, max(len(hidden), 1), chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        parts.append(checkpoint(piece, h, t, use_reentrant=False) if recompute else piece(h, t))
    logp = torch.cat([p[0] for p in parts])
    return logp, torch.cat([p[1] for p in parts]) if entropy else None


def _last_hidden(model: nn.Module, **inputs) -> torch.Tensor:
    """The decoder's last hidden states [B, W, H] (after its final norm: what the LM head reads) for
    `inputs`. The call goes through `model` itself, so that under DDP each backward follows a wrapped
    forward as DDP requires; the LM head is asked for no position (an empty `logits_to_keep`), and the
    hidden states are taken from the decoder's output as it returns."""
    captured: list[torch.Tensor] = []

    def keep(_module, _args, output) -> None:
        captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    device = next(model.parameters()).device
    handle = _unwrap(model).get_decoder().register_forward_hook(keep)
    try:
        model(**inputs, logits_to_keep=torch.zeros(0, dtype=torch.long, device=device))
    finally:
        handle.remove()
    return captured[-1]


def _batch_hidden(model, prompts, completions, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states predicting every completion token [N, H] (pair after pair, N the completions'
    total length), and those tokens [N], from one right-padded batch of whole sequences."""
    sequences = [np.concatenate([p, c]).astype(np.int64) for p, c in zip(prompts, completions, strict=True)]
    width = max(len(s) for s in sequences)
    input_ids = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        input_ids[i, : len(seq)] = torch.from_numpy(seq)
    input_ids = input_ids.to(device)
    position_ids = torch.arange(width, device=device).expand(len(sequences), width)
    # No attention mask: the padding is on the right and attention is causal, so no real position ever
    # attends to a pad and the real positions' states are those of a masked batch (bit for bit on CPU);
    # without a mask the attention takes its fused causal kernel (~1.9x faster forward + backward).
    hidden = _last_hidden(model, input_ids=input_ids, position_ids=position_ids, use_cache=False)
    # The state at position t predicts the token at t + 1: row i's completion is predicted from
    # len(prompt) - 1 on. One gather (its backward one scatter), not a slice per pair.
    starts = [i * width + len(p) - 1 for i, p in enumerate(prompts)]
    rows = np.concatenate([np.arange(s, s + len(c)) for s, c in zip(starts, completions, strict=True)])
    index = torch.from_numpy(rows).to(device)
    states = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
    return states, input_ids.reshape(-1).index_select(0, index + 1)


def _shared_prompt_hidden(
    model, prompts, completions, owners, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As `_batch_hidden`, computing each distinct prompt once: a causal pass over the distinct prompts
    (right-padded, its key/value cache kept with gradients), then the completions as one batch attending
    to their own prompt's cache and their own earlier tokens. For K candidates of prompts P long with
    completions C long, attention costs about P^2 + K(PC + C^2) instead of K(P + C)^2. The rows come
    grouped (every pair's first one, from the prompts' pass, then the others, from the completions'),
    with the order [N] that puts them pair after pair."""
    from transformers import DynamicCache

    # The prompts' pass runs on the module itself: under DDP one wrapped forward (the completions') per
    # backward, as DDP documents; the gradients through the shared cache reach every parameter anyway.
    inner = _unwrap(model)
    distinct = [prompts[owners.index(u)] for u in range(max(owners) + 1)]
    lengths = [len(p) for p in distinct]
    p_width = max(lengths)
    cache = DynamicCache(config=inner.config)
    # The distinct prompts' common first part (at least one token of each is left to run on its own):
    # one pass over it, its cache repeated for every distinct prompt, then the rest of each prompt.
    shared = common_prefix_length(distinct) if len(distinct) > 1 else 0
    shared = shared if shared >= MIN_SHARED_PREFIX else 0
    none = torch.zeros(0, dtype=torch.long, device=device)  # no logits: only the cache is wanted
    if shared:
        prefix = torch.from_numpy(distinct[0][:shared].astype(np.int64))[None].to(device)
        inner(input_ids=prefix, past_key_values=cache, use_cache=True, logits_to_keep=none)
        cache.batch_select_indices(torch.zeros(len(distinct), dtype=torch.long, device=device))
    prompt_ids = torch.zeros((len(distinct), p_width - shared), dtype=torch.long)
    for u, prompt in enumerate(distinct):
        prompt_ids[u, : len(prompt) - shared] = torch.from_numpy(prompt[shared:].astype(np.int64))
    prompt_ids = prompt_ids.to(device)
    prompt_hidden = _last_hidden(
        inner,
        input_ids=prompt_ids,
        position_ids=torch.arange(shared, p_width, device=device).expand_as(prompt_ids),
        past_key_values=cache,
        use_cache=True,
    )  # [U, p_width - shared, H]
    cache.batch_select_indices(torch.tensor(owners, device=device))  # each completion's own prompt
    c_width = max(len(c) for c in completions)
    completion_ids = torch.zeros((len(completions), c_width), dtype=torch.long)
    for i, completion in enumerate(completions):
        completion_ids[i, : len(completion)] = torch.from_numpy(completion.astype(np.int64))
    completion_ids = completion_ids.to(device)
    starts = torch.tensor([lengths[u] for u in owners], device=device)
    mask = _completion_mask(starts, p_width, c_width, _attention_dtype(inner, device))
    completion_hidden = _last_hidden(
        model,
        input_ids=completion_ids,
        position_ids=starts[:, None] + torch.arange(c_width, device=device)[None, :],
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
    )  # [N, c_width, H]
    # Pair i's first token is predicted by its prompt's last state, token t >= 1 by its own state t - 1.
    pairs = [i for i, c in enumerate(completions) if len(c)]
    firsts = [owners[i] * (p_width - shared) + lengths[owners[i]] - 1 - shared for i in pairs]
    rests = torch.from_numpy(np.concatenate([i * c_width + np.arange(len(completions[i]) - 1) for i in pairs]))
    rests, size = rests.to(device), prompt_hidden.shape[-1]
    hidden = torch.cat([
        prompt_hidden.reshape(-1, size).index_select(0, torch.tensor(firsts, dtype=torch.long, device=device)),
        completion_hidden.reshape(-1, size).index_select(0, rests),
    ])  # fmt: skip
    tokens = completion_ids.reshape(-1)
    targets = torch.cat([
        tokens.index_select(0, torch.tensor([i * c_width for i in pairs], dtype=torch.long, device=device)),
        tokens.index_select(0, rests + 1),
    ])  # fmt: skip
    # Row of pair i's token t: its first row, or len(pairs) + where its others start + t - 1.
    order, rest_at = [], len(pairs)
    for n, i in enumerate(pairs):
        order.append(n)
        order.extend(range(rest_at, rest_at + len(completions[i]) - 1))
        rest_at += len(completions[i]) - 1
    return hidden, targets, torch.tensor(order, dtype=torch.long, device=device)


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
    return bool(getattr(_unwrap(model), "is_gradient_checkpointing", False))


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel wrapper (peft's wrapper stays: it delegates)."""
    return getattr(model, "module", model)


def _output_head(model: nn.Module) -> nn.Module:
    """The LM head (with LoRA adapters where they wrap it), refusing a model whose logits are more than it."""
    inner = _unwrap(model)
    config = getattr(inner, "config", None)
    extra = [k for k in _UNSUPPORTED_HEADS if getattr(config, k, None) not in (None, 1, 1.0)]
    if extra:
        raise ValueError(
            f"the trainer computes log-probs as the LM head of the last hidden state, but this "
            f"{getattr(config, 'model_type', 'model')} model's logits also use {extra[0]}"
        )
    return inner.get_output_embeddings()


def _vocab_size(head: nn.Module) -> int:
    """Logits per position of the LM `head` (a Linear, with or without adapters)."""
    return int(getattr(head, "out_features", None) or head.weight.shape[0])
