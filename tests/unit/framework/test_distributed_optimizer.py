"""The distributed optimiser on one rank (`trainer.distributed_optimizer`; several ranks:
tests/integration/test_distributed_optimizer.py): a bf16 policy's model and gradients held in bf16 in flat
buffers, computed without autocast, the float32 master and Adam state beside them (4 + 12 bytes a
parameter); the same update as without it; the settings it does not support refused with a sentence; and
LoRA's frozen base held in the served bf16, never upcast."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mas_async.config import ConfigError, load_config
from mas_async.tiny_model import materialise
from mas_async.training.learner import PolicyLearner
from mas_async.training.logprobs import completion_logprobs
from mas_async.wire.samples import Sample
from tests.support.paths import ROOT

DO = "trainer.distributed_optimizer=true"
BF16 = "policies.vertical.dtype=bfloat16"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(materialise("builtin:tiny-char", tmp_path_factory.mktemp("models")))


def _learner(model_path: str, *overrides: str) -> PolicyLearner:
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["policies.vertical.lr=1e-5", *overrides])
    torch.manual_seed(0)
    return PolicyLearner(config, "vertical", model_path)


def _batch(learner: PolicyLearner) -> list[Sample]:
    prompt = np.array([1, 5, 6, 7, 8], dtype=np.int32)
    samples = []
    for i, reward in enumerate((1.0, -1.0, 0.5, -0.5)):
        completion = np.array([20 + i, 3, 9 + i, 4], dtype=np.int32)
        with torch.no_grad():
            lp = completion_logprobs(learner.model, [prompt], [completion])[0].float().numpy()
        samples.append(Sample("e/vertical/0", "e", "p", "vertical", "vertical", 0, prompt, completion, lp, 0, reward))
    return samples


def _within(storage: torch.Tensor, t: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()


def test_a_bf16_policy_holds_bf16_weights_and_gradients_and_its_float32_master_in_the_optimiser(model_path):
    learner = _learner(model_path, DO, BF16)
    samples = _batch(learner)
    metrics = learner.step(samples, 0)
    opt = learner.distributed
    params = list(learner.model.parameters())
    count = sum(p.numel() for p in params)
    assert not learner.autocast and learner.served is None
    # Weights and gradients: bf16, views of one flat buffer each (2 + 2 bytes a parameter); the weight sync
    # sends the model's own parameters, views of the buffer it broadcasts as it is.
    assert [b.dtype for b in opt.buffers] == [torch.bfloat16] and opt.buffers[0].numel() == count
    for p in params:
        assert p.dtype == p.grad.dtype == torch.bfloat16
        assert _within(opt.buffers[0], p) and _within(opt.grads[0], p.grad)
    assert all(_within(opt.buffers[0], t) for _, t in learner.named_tensors())
    # The float32 master and Adam's two moments: 4 + 8 bytes a parameter, all of it on one rank.
    assert [m.dtype for m in opt.master] == [torch.float32] and opt.master[0].numel() == count
    assert metrics["optimizer_state_bytes"] == pytest.approx(12 * count, rel=1e-3)
    # The weights are the float32 master rounded to bf16, and every master entry moved (lr 1e-5 is below
    # half a bf16 ulp of most weights: the master keeps what the bf16 weights cannot).
    assert torch.equal(opt.buffers[0], opt.master[0].to(torch.bfloat16))
    assert metrics["trainer/changed_fraction"] > 0.95
    assert 0.9 < metrics["grad_norm"] < 1e3


def test_one_rank_makes_the_update_of_the_float32_learner_without_it(model_path):
    """float32 policy: the same weights after a step of two optimiser steps with the gradient clipped (its
    norm is above 1; Adam's second step sees the scale of each)."""
    plain = _learner(model_path, "algorithm.ppo_epochs=2")
    samples = _batch(plain)
    expected = plain.step(samples, 0)
    ours = _learner(model_path, DO, "algorithm.ppo_epochs=2")
    metrics = ours.step(samples, 0)
    assert expected["grad_norm"] > 1.0  # trainer.grad_clip: the clipping is part of the update compared
    assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    for (_, a), (_, b) in zip(plain.trained, ours.trained, strict=True):
        assert torch.allclose(a, b, atol=1e-7, rtol=0)
    opt = ours.distributed  # the weights are the master (float32 policy: no rounding)
    assert all(torch.equal(m, b) for m, b in zip(opt.master, opt.buffers, strict=True))


@pytest.mark.parametrize(
    "overrides, words",
    [
        ([DO, "trainer.zero=true"], "trainer.zero=true"),
        ([DO, "policies.vertical.lora={r: 4}"], "policies.vertical.lora"),
        ([DO, "policies.vertical.dtype=float16"], "policies.vertical.dtype=float16"),
    ],
    ids=["zero", "lora", "float16"],
)
def test_what_the_distributed_optimiser_does_not_do_is_refused_with_a_sentence(overrides, words):
    with pytest.raises(ConfigError, match="trainer.distributed_optimizer=true") as error:
        load_config(ROOT / "configs/plan_path_tiny.yaml", overrides)
    assert words in str(error.value)


def test_lora_holds_its_frozen_base_in_the_served_bf16_and_its_adapters_in_float32(model_path):
    """The base is not upcast to the float32 master: 2 bytes a base weight on the trainer, and a step leaves
    it as it was; only the adapters are in float32 (the optimiser's)."""
    learner = _learner(model_path, BF16, "policies.vertical.lora={r: 4}")
    adapters = {id(p) for _, p in learner.trained}
    base = [p for p in learner.model.parameters() if id(p) not in adapters]
    before = [p.detach().clone() for p in base]
    learner.step(_batch(learner), 0)
    assert base and all(p.dtype == torch.bfloat16 and not p.requires_grad for p in base)
    assert all(torch.equal(p, b) for p, b in zip(base, before, strict=True))
    assert {p.dtype for _, p in learner.trained} == {torch.float32}
