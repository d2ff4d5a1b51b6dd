"""The loss of one micro-batch: the policy term (PPO-clip, or the off-policy correction in stale mode),
plus the KL penalty to the reference and the entropy bonus, over padded [batch, tokens] tensors."""

from __future__ import annotations

import torch

from mas_async.config import AlgorithmConfig
from mas_async.training.loss import aggregate, kl_k3, ppo_clip_loss
from mas_async.training.off_policy import off_policy_loss


def micro_batch_loss(
    algo: AlgorithmConfig,
    new: torch.Tensor,
    old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normalizer: float,
    *,
    behaviour: torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss to backpropagate and its parts: "loss" (the policy term), "kl", "entropy",
    "clip_fraction", and with `behaviour` (stale mode) the importance-weight statistics."""
    parts: dict[str, float] = {}
    if behaviour is None:
        loss, clip = ppo_clip_loss(
            new, old, advantages, mask,
            clip_low=algo.clip_low, clip_high=algo.clip_high, loss_agg=algo.loss_agg, normalizer=normalizer,
        )  # fmt: skip
    else:
        loss, clip = off_policy_loss(
            algo.off_policy, new, old, behaviour, advantages, mask, is_cap=algo.is_cap, is_mode=algo.is_mode,
            clip_low=algo.clip_low, clip_high=algo.clip_high, loss_agg=algo.loss_agg, normalizer=normalizer,
        )  # fmt: skip
        parts.update({k: clip[k] for k in ("is_weight_mean", "is_weight_max", "is_truncated_tokens")})
    parts["loss"] = float(loss.detach())
    parts["clip_fraction"] = clip["clip_fraction"]
    if ref is not None:
        kl = aggregate(kl_k3(new, ref), mask, algo.loss_agg, normalizer)
        loss = loss + algo.kl_coef * kl
        parts["kl"] = float(kl.detach())
    if entropy is not None:
        mean_entropy = aggregate(entropy, mask, algo.loss_agg, normalizer)
        loss = loss - algo.entropy_coef * mean_entropy
        parts["entropy"] = float(mean_entropy.detach())
    return loss, parts
