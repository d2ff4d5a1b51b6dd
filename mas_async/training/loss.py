"""The PPO clipped surrogate loss used by GRPO-style training (one advantage per sequence).

Per token: ratio = exp(logprobs - old_logprobs) and loss = -min(ratio * A, clip(ratio, 1 - clip_low,
1 + clip_high) * A), with asymmetric clipping ("clip-higher") when clip_high > clip_low.
Aggregation:
- "token_mean" (default): the sum over all valid tokens divided by `normalizer`, the number of valid
  tokens of the whole step. When a step accumulates gradients over micro-batches, the caller passes
  the step's global token count, so that the sum of the micro-batch losses equals the loss of the
  full batch.
- "seq_mean": the mean over sequences of each sequence's own token mean (`normalizer` = number of
  sequences of the step).
Optional per-token `weights` multiply each token's loss (the importance weights of the decoupled
objective of `off_policy.py`); without them the loss is exactly the plain one.
"""

from __future__ import annotations

import torch

LOSS_AGGREGATIONS = ("token_mean", "seq_mean")


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    loss_agg: str = "token_mean",
    normalizer: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Return the scalar loss and metrics {clip_fraction, ratio_mean} over the valid tokens.

    logprobs, old_logprobs, mask (and weights, if given): [B, T] (right-padded; mask is 1 on completion
    tokens); advantages: [B]. Gradients flow through `logprobs` only.
    """
    if loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss_agg {loss_agg!r}; known: {list(LOSS_AGGREGATIONS)}")
    if logprobs.dim() != 2 or old_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs, old_logprobs and mask must share one [B, T] shape, got {list(logprobs.shape)}, "
            f"{list(old_logprobs.shape)} and {list(mask.shape)}"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B] = [{logprobs.shape[0]}], got {list(advantages.shape)}")

    mask = mask.to(logprobs.dtype)
    adv = advantages.detach().to(logprobs.dtype)[:, None]
    ratio = torch.exp(logprobs - old_logprobs.detach())
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if weights is not None:
        if weights.shape != logprobs.shape:
            raise ValueError(f"weights must be [B, T] = {list(logprobs.shape)}, got {list(weights.shape)}")
        per_token = per_token * weights.detach().to(per_token.dtype)

    loss = aggregate(per_token, mask, loss_agg, normalizer)

    with torch.no_grad():
        # A token is clipped when the clipped branch wins the min, so its gradient is zero.
        is_clipped = ((ratio < 1.0 - clip_low) & (adv < 0)) | ((ratio > 1.0 + clip_high) & (adv > 0))
        valid = max(float(mask.sum()), 1.0)
        metrics = {
            "clip_fraction": float((is_clipped.to(mask.dtype) * mask).sum()) / valid,
            "ratio_mean": float((ratio * mask).sum()) / valid,
        }
    return loss, metrics


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, loss_agg: str, normalizer: float | None = None
) -> torch.Tensor:
    """Reduce a [B, T] per-token quantity to a scalar the way the policy loss is reduced (`loss_agg`);
    the KL and entropy terms use it too, so every term of the objective is averaged alike."""
    if loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss_agg {loss_agg!r}; known: {list(LOSS_AGGREGATIONS)}")
    mask = mask.to(per_token.dtype)
    if loss_agg == "token_mean":
        total = mask.sum() if normalizer is None else normalizer
        return (per_token * mask).sum() / max(float(total), 1.0)
    seq_means = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    total = per_token.shape[0] if normalizer is None else normalizer
    return seq_means.sum() / max(float(total), 1.0)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate "k3" (Schulman): exp(r) - r - 1 with r = ref - logp;
    non-negative, unbiased, low variance; gradients flow through `logprobs`."""
    r = ref_logprobs.detach() - logprobs
    return torch.exp(r) - r - 1.0
