"""The loss's correction for stale samples: decoupled PPO reduces to PPO-clip when behaviour equals
proximal (equal loss and gradient), the importance weights and their truncation match a hand
computation at k=1, TIS is the truncated-IS policy gradient, and "none" is PPO against the behaviour."""

from __future__ import annotations

import math

import pytest
import torch

from mas_async.training.loss import ppo_clip_loss
from mas_async.training.off_policy import off_policy_loss

CLIP = {"clip_low": 0.2, "clip_high": 0.2, "loss_agg": "token_mean", "normalizer": None}


def _inputs():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]], requires_grad=True)
    proximal = torch.tensor([[-1.1, -1.9, -0.5], [-0.4, -1.0, 0.0]])
    advantages = torch.tensor([1.5, -0.5])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return logprobs, proximal, advantages, mask


def test_decoupled_with_fresh_samples_is_exactly_ppo_clip():
    logprobs, proximal, advantages, mask = _inputs()
    plain, _ = ppo_clip_loss(logprobs, proximal, advantages, mask, **CLIP)
    (grad_plain,) = torch.autograd.grad(plain, logprobs)
    loss, metrics = off_policy_loss(
        "decoupled", logprobs, proximal, proximal.clone(), advantages, mask, is_cap=2.0, **CLIP
    )
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert float(loss.detach()) == float(plain.detach()) and torch.equal(grad, grad_plain)
    assert metrics["is_weight_mean"] == 1.0 and metrics["is_truncated_tokens"] == 0


def test_decoupled_weights_by_hand_at_staleness_one():
    """Two tokens of a sample generated one version ago: w = min(exp(prox - behav), cap)."""
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    proximal = torch.tensor([[-1.0, -1.0]])
    behaviour = torch.tensor([[-1.5, -3.0]])  # w = e^0.5 = 1.6487, e^2 = 7.389 -> truncated to 2
    advantages, mask = torch.tensor([2.0]), torch.ones(1, 2)
    loss, metrics = off_policy_loss("decoupled", logprobs, proximal, behaviour, advantages, mask, is_cap=2.0, **CLIP)
    # token 1: ratio 1 -> -w*A = -1.6487*2; token 2: ratio e^-1 = 0.368 < 0.8 with A > 0: min(r A, 0.8 A) = r A
    r2 = math.exp(-1.0)
    expected = (-(math.exp(0.5) * 2.0) - 2.0 * (r2 * 2.0)) / 2
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logprobs)
    # d/dlogp of -w * r * A = -w * r * A (r = exp(logp - prox)), averaged over 2 tokens
    assert grad.tolist()[0] == pytest.approx([-math.exp(0.5) * 2.0 / 2, -2.0 * r2 * 2.0 / 2], rel=1e-6)
    assert metrics["is_weight_max"] == pytest.approx(math.exp(2.0), rel=1e-6)
    assert metrics["is_truncated_tokens"] == 1
    assert metrics["is_weight_mean"] == pytest.approx((math.exp(0.5) + math.exp(2.0)) / 2, rel=1e-6)


def test_tis_is_the_truncated_importance_weighted_policy_gradient():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.2, -3.5]])  # w = e^0.2, e^1.5 -> 2 (truncated)
    advantages, mask = torch.tensor([-1.0]), torch.ones(1, 2)
    loss, metrics = off_policy_loss("tis", logprobs, behaviour, behaviour, advantages, mask, is_cap=2.0, **CLIP)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert grad.tolist()[0] == pytest.approx([math.exp(0.2) / 2, 2.0 / 2], rel=1e-6)  # -w * A / tokens
    assert metrics["is_truncated_tokens"] == 1 and metrics["clip_fraction"] == 0.0


def test_none_is_ppo_clip_against_the_behaviour_log_probs():
    logprobs, proximal, advantages, mask = _inputs()
    behaviour = proximal - 0.3
    plain, _ = ppo_clip_loss(logprobs, behaviour, advantages, mask, **CLIP)
    loss, _ = off_policy_loss("none", logprobs, proximal, behaviour, advantages, mask, is_cap=2.0, **CLIP)
    assert float(loss.detach()) == float(plain.detach())


def test_an_unknown_mode_is_named():
    logprobs, proximal, advantages, mask = _inputs()
    with pytest.raises(ValueError, match="unknown algorithm.off_policy 'vtrace'"):
        off_policy_loss("vtrace", logprobs, proximal, proximal, advantages, mask, is_cap=2.0, **CLIP)


def test_mask_mode_leaves_the_tokens_above_the_cap_out_of_the_loss():
    """is_mode=mask (AReaL's filter): the token whose weight e^2 exceeds the cap contributes no loss and no
    gradient, the other one is weighted as under truncation, and the denominator still counts both tokens."""
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    proximal = torch.tensor([[-1.0, -1.0]])
    behaviour = torch.tensor([[-1.5, -3.0]])  # w = e^0.5 (kept), e^2 (above the cap of 2: masked)
    advantages, mask = torch.tensor([2.0]), torch.ones(1, 2)
    loss, metrics = off_policy_loss(
        "decoupled", logprobs, proximal, behaviour, advantages, mask, is_cap=2.0, is_mode="mask", **CLIP
    )
    assert float(loss.detach()) == pytest.approx(-(math.exp(0.5) * 2.0) / 2, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert grad.tolist()[0] == pytest.approx([-math.exp(0.5) * 2.0 / 2, 0.0], abs=1e-7)
    assert metrics["is_truncated_tokens"] == 1 and metrics["is_weight_max"] == pytest.approx(math.exp(2.0))
    tis = torch.tensor([[-1.2, -3.5]])  # w = e^0.2 (kept), e^1.5 (masked)
    loss, _ = off_policy_loss("tis", logprobs, proximal, tis, torch.tensor([-1.0]), mask, is_cap=2.0,
                              is_mode="mask", **CLIP)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert grad.tolist()[0] == pytest.approx([math.exp(0.2) / 2, 0.0], abs=1e-7)
    with pytest.raises(ValueError, match="is_mode"):
        off_policy_loss("tis", logprobs, proximal, tis, advantages, mask, is_cap=2.0, is_mode="drop", **CLIP)


def test_the_learner_objective_takes_is_mode_from_the_config():
    from mas_async.config import AlgorithmConfig
    from mas_async.training.objective import micro_batch_loss

    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    proximal, behaviour = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.5, -3.0]])
    advantages, mask = torch.tensor([2.0]), torch.ones(1, 2)
    losses = {}
    for mode in ("truncate", "mask"):
        loss, _ = micro_batch_loss(AlgorithmConfig(is_mode=mode), logprobs, proximal, advantages, mask, 2.0,
                                   behaviour=behaviour)  # fmt: skip
        losses[mode] = loss.item()
    assert losses["mask"] == pytest.approx(-math.exp(0.5) * 2.0 / 2, rel=1e-6)
    assert losses["truncate"] < losses["mask"]  # the second token, weighted by the cap, adds to the objective
