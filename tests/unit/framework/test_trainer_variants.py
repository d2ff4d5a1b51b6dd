"""Trainer variants: PPO epochs and mini-batches, learning-rate schedule, KL to the frozen reference,
entropy bonus, and two shortcuts being exact: zero-advantage samples skip the backward, and a step of one
optimiser step takes its old log-probs from its training pass."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mas_async.config import TrainerConfig, load_config
from mas_async.tiny_model import materialise
from mas_async.training.learner import PolicyLearner, lr_lambda
from mas_async.training.logprobs import completion_logprobs
from mas_async.wire.samples import Sample
from tests.support.paths import ROOT


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(materialise("builtin:tiny-char", tmp_path_factory.mktemp("models")))


def _learner(model_path, *overrides):
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", list(overrides))
    return PolicyLearner(config, "vertical", model_path)


def _batch(learner, rewards=(1.0, -1.0, 1.0, -1.0), tokens=(20, 21, 22, 23)):
    prompt = np.array([1, 5, 6, 7, 8], dtype=np.int32)
    samples = []
    for i, (token, reward) in enumerate(zip(tokens, rewards, strict=True)):
        completion = np.array([token], dtype=np.int32)
        with torch.no_grad():
            lp = completion_logprobs(learner.model, [prompt], [completion])[0].numpy()
        samples.append(
            Sample(
                "e/vertical/0", "e", "p", "vertical", "vertical", 0, prompt, completion, lp, 0, reward, info={"i": i}
            )
        )
    return samples


def test_epochs_and_mini_batches_count_optimiser_steps(model_path):
    learner = _learner(model_path, "algorithm.ppo_epochs=2", "algorithm.mini_batches=2")
    metrics = learner.step(_batch(learner))
    assert metrics["optimizer_steps"] == 4


def test_second_epoch_is_off_policy_in_ratio_only(model_path):
    # After the first epoch's step the ratio moves away from 1, so clipping can act in the second.
    learner = _learner(model_path, "algorithm.ppo_epochs=3", "policies.vertical.lr=0.05", "algorithm.clip_low=0.01",
                       "algorithm.clip_high=0.01")  # fmt: skip
    metrics = learner.step(_batch(learner))
    assert metrics["clip_fraction"] > 0.0


def test_lr_schedule_warmup_then_cosine_to_the_floor():
    trainer = TrainerConfig(lr_schedule="cosine", warmup_steps=4, min_lr_ratio=0.1)
    f = lr_lambda(trainer, total_steps=14)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    constant = lr_lambda(TrainerConfig(), total_steps=10)
    assert all(constant(s) == 1.0 for s in range(20))


def test_kl_is_zero_at_the_reference_and_positive_after_moving(model_path):
    learner = _learner(model_path, "algorithm.kl_coef=0.1", "policies.vertical.lr=0.05")
    first = learner.step(_batch(learner))
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # the policy still equals the frozen reference
    second = learner.step(_batch(learner))
    assert second["kl"] > 1e-6


def test_entropy_bonus_raises_entropy_when_advantages_are_zero(model_path):
    learner = _learner(model_path, "algorithm.entropy_coef=1.0", "policies.vertical.lr=0.002")
    batch = _batch(learner, rewards=(0.0, 0.0, 0.0, 0.0))  # no policy-gradient signal at all
    before = learner.step(batch)["entropy"]
    after = learner.step(_batch(learner, rewards=(0.0, 0.0, 0.0, 0.0)))["entropy"]
    assert before > 0 and after > before


def test_zero_advantage_shortcut_is_exact(model_path):
    """Skipping zero-advantage samples gives the same update as putting them through backward."""
    a = _learner(model_path, "policies.vertical.lr=0.01")
    b = _learner(model_path, "policies.vertical.lr=0.01", "algorithm.entropy_coef=1e-30")  # forces all through
    rewards = (1.0, -1.0, 0.0, 0.0)
    samples_a = _batch(a, rewards) + [
        Sample("x/vertical/0", "x", "q", "vertical", "vertical", 0, np.array([1, 9], dtype=np.int32),
               np.array([20], dtype=np.int32), np.array([-3.9], dtype=np.float32), 0, 0.5)
    ]  # fmt: skip
    samples_b = _batch(b, rewards) + [samples_a[-1]]
    grads_a, grads_b = _step_gradients(a), _step_gradients(b)
    a.step(samples_a)
    b.step(samples_b)
    assert len(grads_a) == len(grads_b) == 1 and grads_a[0].abs().max() > 1e-3
    torch.testing.assert_close(grads_a[0], grads_b[0], rtol=1e-5, atol=1e-7)


def _with_zero_advantages(learner):
    """Two samples with an advantage and three without (a tied pair and a group of one)."""
    return _batch(learner, (1.0, -1.0, 0.0, 0.0)) + [
        Sample("x/vertical/0", "x", "q", "vertical", "vertical", 0, np.array([1, 9], dtype=np.int32),
               np.array([20], dtype=np.int32), np.array([-3.9], dtype=np.float32), 0, 0.5)
    ]  # fmt: skip


def _recomputed(learner) -> list[int]:
    """Samples per no-grad log-prob pass of the learner's model (the old log-probs' recompute)."""
    counts: list[int] = []
    logprobs = learner._logprobs

    def counting(model, samples, entropies=None):
        if not torch.is_grad_enabled() and model is learner.model:
            counts.append(len(samples))
        return logprobs(model, samples, entropies)

    learner._logprobs = counting
    return counts


@pytest.mark.parametrize("stale", [False, True])
def test_one_optimiser_step_takes_its_old_logprobs_from_its_training_pass(model_path, stale):
    """The no-grad recompute covers only the samples the training pass skips, and the update and the
    on-policy proof are those of recomputing every sample (strict, and stale mode's decoupled loss)."""
    overrides = ["policies.vertical.lr=0.01", *(["rollout.max_staleness=1"] if stale else [])]
    reused, recomputed = _learner(model_path, *overrides), _learner(model_path, *overrides)
    recomputed.force_recompute = True
    assert reused.reuses_training_logprobs() and not recomputed.reuses_training_logprobs()
    counts = {"reused": _recomputed(reused), "recomputed": _recomputed(recomputed)}
    grads = {"reused": _step_gradients(reused), "recomputed": _step_gradients(recomputed)}
    metrics = {
        "reused": reused.step(_with_zero_advantages(reused), 0),
        "recomputed": recomputed.step(_with_zero_advantages(recomputed), 0),
    }
    assert counts == {"reused": [3], "recomputed": [5]}
    torch.testing.assert_close(grads["reused"][0], grads["recomputed"][0], rtol=1e-5, atol=1e-7)
    assert grads["reused"][0].abs().max() > 1e-3
    for key in ("loss", "clip_fraction", "logprob_abs_diff", "logprob_abs_diff_max"):
        assert metrics["reused"][key] == pytest.approx(metrics["recomputed"][key], rel=1e-5, abs=1e-7), key
    assert metrics["reused"]["logprob_abs_diff_max"] > 1e-3  # the group of one (no advantage) is checked too


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.ppo_epochs=2"],  # the second epoch's ratio is against the weights before the first
        ["algorithm.mini_batches=2"],
        ["algorithm.old_logprobs=rollout"],  # the recompute is the proof's only
        ["policies.vertical.lora={r: 4, alpha: 8, dropout: 0.1}"],  # a training pass drops, the recompute not
        ["attention_dropout"],
    ],
    ids=["epochs", "mini_batches", "rollout_old", "lora_dropout", "attention_dropout"],
)
def test_old_logprobs_are_recomputed_for_every_sample_where_the_training_pass_differs(model_path, overrides):
    learner = _learner(model_path, *[o for o in overrides if o != "attention_dropout"])
    if overrides == ["attention_dropout"]:
        learner.model.config.attention_dropout = 0.1
    counts = _recomputed(learner)
    assert not learner.reuses_training_logprobs()
    learner.step(_with_zero_advantages(learner))
    assert counts == [5]


def _layer_calls(learner) -> list[torch.dtype]:
    """The output dtype of every call of the first decoder layer's first linear module, recorded by a hook."""
    calls: list[torch.dtype] = []
    linear = next(m for m in learner.model.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda module, args, out: calls.append(out.dtype))
    return calls


def _step_gradients(learner) -> list[torch.Tensor]:
    """The flat gradient at every optimiser step, recorded as the step begins. The tests compare these,
    not the weights after Adam: batches of other shapes round differently (~1e-7), and Adam's first step
    (g / (|g| + eps)) turns that into ~1e-3 of lr on an element whose gradient is ~1e-9."""
    grads: list[torch.Tensor] = []
    params = list(learner.model.parameters())
    learner.optimizer.register_step_pre_hook(
        lambda *_: grads.append(torch.cat([p.grad.flatten() for p in params if p.grad is not None]))
    )
    return grads


def _flat(learner) -> torch.Tensor:
    return torch.cat([t.flatten().float() for _, t in learner.named_tensors()])


def test_activation_checkpointing_recomputes_in_the_backward_and_gives_the_same_update(model_path):
    plain = _learner(model_path, "policies.vertical.lr=0.01")
    checkpointed = _learner(model_path, "policies.vertical.lr=0.01", "trainer.activation_checkpointing=true")
    before, batch = _flat(plain), _batch(plain)
    calls_plain, calls_checkpointed = _layer_calls(plain), _layer_calls(checkpointed)
    grads_plain, grads_checkpointed = _step_gradients(plain), _step_gradients(checkpointed)
    plain.step(batch)
    checkpointed.step(batch)
    # plain: the forward, a pass over the shared prompt and one over the completions (the old log-probs
    # are its own: one optimiser step); checkpointed (no key/value cache, so whole sequences): one pass,
    # and the layer again during the backward.
    assert (len(calls_plain), len(calls_checkpointed)) == (2, 2)
    assert not torch.equal(_flat(plain), before)  # the step moved the weights
    torch.testing.assert_close(grads_checkpointed, grads_plain, rtol=1e-5, atol=1e-7)


def test_bf16_autocast_runs_the_forward_in_bfloat16_and_keeps_fp32_weights(model_path):
    plain = _learner(model_path, "policies.vertical.lr=0.01")
    bf16 = _learner(model_path, "policies.vertical.lr=0.01", "trainer.bf16_autocast=true")
    before, batch = _flat(plain), _batch(plain)
    calls_plain, calls_bf16 = _layer_calls(plain), _layer_calls(bf16)
    exact, rounded = plain.step(batch), bf16.step(batch)
    assert set(calls_plain) == {torch.float32} and set(calls_bf16) == {torch.bfloat16}
    assert all(t.dtype == torch.float32 for _, t in bf16.named_tensors())  # weights and updates stay fp32
    # bf16 rounding shows in the recompute against the fp32 rollout log-probs, and the update still agrees.
    assert exact["logprob_abs_diff"] < 1e-5 < rounded["logprob_abs_diff"] < 0.1
    step_plain, step_bf16 = _flat(plain) - before, _flat(bf16) - before
    assert torch.nn.functional.cosine_similarity(step_plain, step_bf16, dim=0) > 0.9


def _entropy(learner, samples) -> float:
    """The mean next-token entropy over every completion token of `samples` under the learner's weights now."""
    entropies: list[torch.Tensor] = []
    with torch.no_grad():
        for s in samples:
            completion_logprobs(learner.model, [s.prompt_ids], [s.completion_ids], learner.temperature, entropies)
    return float(torch.cat(entropies).mean())


@pytest.mark.parametrize("overrides", [[], ["algorithm.ppo_epochs=2"]], ids=["one_step", "epochs"])
def test_a_step_logs_what_it_measured_and_nothing_else(model_path, overrides):
    """Entropy always (of every sample, under the weights before the step, whichever pass measured it);
    grad_norm and clip_fraction only when something went through backward; kl only with a reference."""
    learner = _learner(model_path, "policies.vertical.lr=0.01", *overrides)
    batch = _with_zero_advantages(learner)
    expected = _entropy(learner, batch)
    metrics = learner.step(batch)
    assert metrics["entropy"] == pytest.approx(expected, rel=1e-5) and metrics["entropy"] > 0.1
    assert metrics["grad_norm"] >= 0.0 and 0.0 <= metrics["clip_fraction"] <= 1.0  # (a clipped epoch: 0.0)
    assert metrics["logprob_abs_diff"] >= 0.0 and "kl" not in metrics
    still = _learner(model_path, *overrides)
    tied = _batch(still, rewards=(0.0, 0.0, 0.0, 0.0))  # no advantage anywhere: nothing goes through backward
    quiet = still.step(tied)
    assert quiet["entropy"] == pytest.approx(_entropy(still, tied), rel=1e-5)
    assert "grad_norm" not in quiet and "clip_fraction" not in quiet and "kl" not in quiet
    assert "logprob_abs_diff" in quiet  # every sample's rollout log-prob is still checked
