"""PPO clip loss: hand-computed values for both aggregations, clipping and the metrics."""

from __future__ import annotations

import math

import pytest
import torch

from mas_async.training.loss import ppo_clip_loss

# old log-probs are 0, so ratio = exp(logprobs) = these values.
RATIOS = [[1.0, 1.5, 0.5], [0.9, 1.1, 2.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
ADVANTAGES = [1.0, -2.0]
# Per-token losses with clip 0.2:  row 0 (A = 1): -1, -min(1.5, 1.2) = -1.2, -min(0.5, 0.8) = -0.5
#                                  row 1 (A = -2): 1.8, 2.2, (masked: 4.0)


def _inputs(requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    logprobs = torch.log(torch.tensor(RATIOS, dtype=torch.float64)).requires_grad_(requires_grad)
    return logprobs, torch.zeros(2, 3, dtype=torch.float64), torch.tensor(ADVANTAGES), torch.tensor(MASK)


def test_token_mean_matches_hand_computation() -> None:
    loss, metrics = ppo_clip_loss(*_inputs())
    assert loss.item() == pytest.approx((-1.0 - 1.2 - 0.5 + 1.8 + 2.2) / 5)
    assert metrics["clip_fraction"] == pytest.approx(1 / 5)  # only row 0, token 1
    assert metrics["ratio_mean"] == pytest.approx((1.0 + 1.5 + 0.5 + 0.9 + 1.1) / 5)
    assert isinstance(metrics["clip_fraction"], float) and isinstance(metrics["ratio_mean"], float)


def test_seq_mean_matches_hand_computation() -> None:
    loss, _ = ppo_clip_loss(*_inputs(), loss_agg="seq_mean")
    assert loss.item() == pytest.approx(((-1.0 - 1.2 - 0.5) / 3 + (1.8 + 2.2) / 2) / 2)


def test_asymmetric_clip_high() -> None:
    loss, metrics = ppo_clip_loss(*_inputs(), clip_low=0.2, clip_high=0.6)
    assert loss.item() == pytest.approx((-1.0 - 1.5 - 0.5 + 1.8 + 2.2) / 5)
    assert metrics["clip_fraction"] == 0.0


def test_global_normalizer_makes_micro_batches_sum_to_the_full_loss() -> None:
    logprobs, old, adv, mask = _inputs()
    full, _ = ppo_clip_loss(logprobs, old, adv, mask)
    parts = [
        ppo_clip_loss(logprobs[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], normalizer=5)[0]
        for i in range(2)
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item())
    seq_parts = [
        ppo_clip_loss(
            logprobs[i : i + 1],
            old[i : i + 1],
            adv[i : i + 1],
            mask[i : i + 1],
            loss_agg="seq_mean",
            normalizer=2,
        )[0]
        for i in range(2)
    ]
    assert (seq_parts[0] + seq_parts[1]).item() == pytest.approx(
        ppo_clip_loss(*_inputs(), loss_agg="seq_mean")[0].item()
    )


def test_gradient_is_zero_on_clipped_and_masked_tokens() -> None:
    logprobs, old, adv, mask = _inputs(requires_grad=True)
    loss, _ = ppo_clip_loss(logprobs, old, adv, mask)
    loss.backward()
    grad = logprobs.grad
    assert grad[0, 1].item() == 0.0  # clipped (ratio 1.5 > 1.2 with A > 0)
    assert grad[1, 2].item() == 0.0  # masked
    # Unclipped: d/dlogp of -ratio * A / 5 = -ratio * A / 5.
    assert grad[0, 2].item() == pytest.approx(-0.5 * 1.0 / 5)
    assert grad[1, 0].item() == pytest.approx(-0.9 * -2.0 / 5)


def test_on_policy_ratio_is_one_and_loss_is_minus_mean_advantage() -> None:
    logprobs = torch.full((2, 3), -1.3)
    loss, metrics = ppo_clip_loss(logprobs, logprobs.clone(), torch.tensor(ADVANTAGES), torch.tensor(MASK))
    assert loss.item() == pytest.approx(-(3 * 1.0 + 2 * -2.0) / 5)
    assert metrics == {"clip_fraction": 0.0, "ratio_mean": pytest.approx(1.0)}
    assert not math.isnan(ppo_clip_loss(logprobs, logprobs, torch.zeros(2), torch.zeros(2, 3))[0].item())


def test_unknown_aggregation_is_named() -> None:
    with pytest.raises(ValueError, match="'sum_all'"):
        ppo_clip_loss(*_inputs(), loss_agg="sum_all")


def test_shape_mismatch_is_reported() -> None:
    logprobs, old, adv, mask = _inputs()
    with pytest.raises(ValueError, match="shape"):
        ppo_clip_loss(logprobs, old[:, :2], adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        ppo_clip_loss(logprobs, old, adv[:1], mask)


# Each clip case on its own token: (ratio, advantage, clipped?). clip_low = 0.2, clip_high = 0.3, so the
# clip range is [0.8, 1.3]. PPO takes the pessimistic branch: min(ratio * A, clip(ratio) * A).
CLIP_LOW, CLIP_HIGH = 0.2, 0.3
CLIP_CASES = [
    (1.5, 1.0, True),  # A > 0, ratio above 1 + clip_high: clipped at 1.3 * A, no gradient
    (0.5, 1.0, False),  # A > 0, ratio below 1 - clip_low: unclipped 0.5 * A is the min, gradient flows
    (0.5, -2.0, True),  # A < 0, ratio below 1 - clip_low: clipped at 0.8 * A, no gradient
    (1.5, -2.0, False),  # A < 0, ratio above 1 + clip_high: unclipped 1.5 * A is the min, gradient flows
    (1.1, 1.0, False),  # inside the range: unclipped either way
    (1.1, -2.0, False),
]


def _clip_case_inputs() -> tuple[torch.Tensor, ...]:
    ratios = torch.tensor([[r] for r, _, _ in CLIP_CASES], dtype=torch.float64)
    old = torch.full_like(ratios, -0.7)  # old log-probs are not 0, so the ratio really is exp(new - old)
    logprobs = (old + torch.log(ratios)).requires_grad_(True)
    advantages = torch.tensor([a for _, a, _ in CLIP_CASES], dtype=torch.float64)
    return logprobs, old, advantages, torch.ones_like(ratios)


def test_clip_on_both_sides_loss_and_gradient_per_case() -> None:
    logprobs, old, advantages, mask = _clip_case_inputs()
    n = len(CLIP_CASES)
    loss, metrics = ppo_clip_loss(logprobs, old, advantages, mask, clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    expected_tokens = []
    for ratio, adv, clipped in CLIP_CASES:
        bound = min(max(ratio, 1 - CLIP_LOW), 1 + CLIP_HIGH)
        expected_tokens.append(-(bound if clipped else ratio) * adv)
    # By hand: -1.3, -0.5, -(0.8 * -2) = 1.6, -(1.5 * -2) = 3.0, -1.1, 2.2.
    assert expected_tokens == pytest.approx([-1.3, -0.5, 1.6, 3.0, -1.1, 2.2])
    assert loss.item() == pytest.approx(sum(expected_tokens) / n)
    assert metrics["clip_fraction"] == pytest.approx(2 / n)
    loss.backward()
    grad = logprobs.grad[:, 0]
    for i, (ratio, adv, clipped) in enumerate(CLIP_CASES):
        # d/dlogp of -ratio * A / n is -ratio * A / n (ratio = exp(logp - old)); a clipped token has none.
        expected = 0.0 if clipped else -ratio * adv / n
        assert grad[i].item() == pytest.approx(expected, abs=1e-12), (ratio, adv)
    # The unclipped far-side tokens carry the gradient that pulls the ratio back (it is not zero).
    assert grad[1].item() < 0 and grad[3].item() > 0


@pytest.mark.parametrize(("ratio", "adv", "clipped"), CLIP_CASES)
def test_each_clip_case_alone_matches_the_pessimistic_bound(ratio: float, adv: float, clipped: bool) -> None:
    old = torch.tensor([[0.3]], dtype=torch.float64)
    logprobs = (old + math.log(ratio)).requires_grad_(True)
    loss, metrics = ppo_clip_loss(
        logprobs, old, torch.tensor([adv]), torch.ones(1, 1), clip_low=CLIP_LOW, clip_high=CLIP_HIGH
    )
    bound = min(max(ratio, 1 - CLIP_LOW), 1 + CLIP_HIGH)
    assert loss.item() == pytest.approx(-min(ratio * adv, bound * adv))
    assert metrics["clip_fraction"] == (1.0 if clipped else 0.0)
    loss.backward()
    assert logprobs.grad.item() == pytest.approx(0.0 if clipped else -ratio * adv, abs=1e-12)
