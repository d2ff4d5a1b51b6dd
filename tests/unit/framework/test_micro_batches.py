"""Gradient accumulation by token budget: the cut of a mini-batch into micro-batches, and the update
being the same as one batch (parameters within 1e-6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mas_async.config import load_config
from mas_async.tiny_model import materialise
from mas_async.training.learner import PolicyLearner
from mas_async.training.logprobs import completion_logprobs
from mas_async.training.micro_batches import micro_batches
from mas_async.wire.samples import Sample
from tests.support.paths import ROOT


def test_cut_respects_both_limits_and_keeps_order():
    assert micro_batches([3, 3, 3, 3], max_sequences=8) == [[0, 1, 2, 3]]
    assert micro_batches([3, 3, 3, 3], max_sequences=3) == [[0, 1, 2], [3]]
    assert micro_batches([3, 3, 3, 3], max_sequences=8, max_tokens=7) == [[0, 1], [2, 3]]
    assert micro_batches([2, 9, 2, 2], max_sequences=8, max_tokens=5) == [[0], [1], [2, 3]]  # 9 runs alone
    assert micro_batches([], max_sequences=2, max_tokens=4) == []
    with pytest.raises(ValueError, match="max_tokens"):
        micro_batches([1], max_sequences=1, max_tokens=0)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(materialise("builtin:tiny-char", tmp_path_factory.mktemp("models")))


def batch(model_path: str, count: int = 8, seed: int = 0) -> list[Sample]:
    """`count` samples in groups of 4 candidates, each group one prompt (as tree sampling gives, so the
    trainer's shared-prompt pass runs), of varied prompt and completion lengths, with the model's own
    log-probs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path)
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(count):
        group = i // 4  # agent_turn groups of 4 candidates
        if i % 4 == 0:
            prompt = rng.integers(1, 30, size=int(rng.integers(3, 9))).astype(np.int32)
        completion = rng.integers(1, 30, size=int(rng.integers(1, 6))).astype(np.int32)
        with torch.no_grad():
            lp = completion_logprobs(model, [prompt], [completion])[0].numpy()
        samples.append(
            Sample(f"e{group}/vertical/0", f"e{group}", "p", "vertical", "vertical", 0, prompt, completion, lp, 0,
                   float(rng.normal()), info={"i": i})
        )  # fmt: skip
    return samples


def stepped(model_path: str, samples: list[Sample], *overrides: str) -> tuple[list[torch.Tensor], dict]:
    # Adam's first step moves each weight by lr * g / (|g| + eps): the float rounding of a near-zero
    # gradient can flip its sign, a change of up to 2 * lr. lr 1e-5 keeps that within the 1e-6 bound.
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["policies.vertical.lr=1e-5", *overrides])
    torch.manual_seed(0)
    learner = PolicyLearner(config, "vertical", model_path)
    metrics = learner.step(samples, 0)
    return [p.detach().clone() for p in learner.model.parameters()], metrics


def test_token_budget_gives_the_same_update_as_one_batch(model_path):
    samples = batch(model_path)
    whole, m_whole = stepped(model_path, samples)
    cut, m_cut = stepped(model_path, samples, "trainer.max_tokens_per_micro_batch=12")
    assert m_whole["micro_batches"] == 1 and m_cut["micro_batches"] >= 4
    moved = max(float((a - b).abs().max()) for a, b in zip(whole, stepped_params_at_start(model_path), strict=True))
    assert moved > 5e-6  # the step did change the weights
    for a, b in zip(whole, cut, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


def stepped_params_at_start(model_path: str) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return [p.detach() for p in AutoModelForCausalLM.from_pretrained(model_path).parameters()]


def test_the_derived_token_budget_follows_the_models_shape():
    """The rule of `token_budget`: 8 GiB of activations at 4 bytes per kept value, 8 hidden-sized and 4
    MLP-sized values per token and layer (with checkpointing: each layer's input, and one layer's worth)."""
    from transformers import Qwen3Config

    from mas_async.tiny_model import build_config
    from mas_async.training.micro_batches import ACTIVATION_BYTES, token_budget

    qwen3_1_7b = Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, vocab_size=151936)
    assert token_budget(qwen3_1_7b) == ACTIVATION_BYTES // (4 * 28 * (8 * 2048 + 4 * 6144)) == 1872
    assert token_budget(qwen3_1_7b, checkpointing=True) == ACTIVATION_BYTES // (4 * (28 * 2048 + 8 * 2048 + 4 * 6144))
    assert token_budget(build_config("tiny-char")) >= 2**20  # the CPU demo's model: no cut in practice


def test_micro_batches_are_cut_by_the_models_token_budget_by_default(model_path, monkeypatch):
    """With `trainer.max_tokens_per_micro_batch` unset the learner cuts by the budget derived from the model
    (here made small), the training pass and the no-grad passes alike; a budget given in the config wins."""
    from mas_async.training import micro_batches as module

    samples = batch(model_path)
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    config = load_config(ROOT / "configs/plan_path_tiny.yaml")
    assert config.trainer.max_tokens_per_micro_batch is None
    learner = PolicyLearner(config, "vertical", model_path)
    per_token = 4 * 2 * (8 * 64 + 4 * 128)  # tiny-char: 2 layers, hidden 64, MLP 128
    monkeypatch.setattr(module, "ACTIVATION_BYTES", 20 * per_token, raising=False)
    runs = learner._micro_batches(samples)
    assert runs == micro_batches(lengths, max_sequences=256, max_tokens=20) and len(runs) >= 4
    assert all(sum(lengths[i] for i in run) <= 20 or len(run) == 1 for run in runs)
    assert learner.step(samples, 0)["micro_batches"] == len(runs)
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["trainer.max_tokens_per_micro_batch=1000"])
    given = PolicyLearner(config, "vertical", model_path)
    assert given._micro_batches(samples) == [list(range(len(samples)))]
