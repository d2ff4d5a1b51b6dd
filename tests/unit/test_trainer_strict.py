"""The trainer's strict on-policy guard: samples of any other weight version are refused and counted,
and a TrainStep whose sample count differs from what the router forwarded is an error."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.messages import Groups, TrainStep, sample_to_wire
from mas_async.samples import Sample
from mas_async.tiny_model import materialise
from mas_async.trainer.trainer import PolicyLearner, Trainer
from tests.integration.launch import ROOT


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = materialise("builtin:tiny-char", tmp_path_factory.mktemp("models"))
    config = load_config(ROOT / "configs/plan_path_tiny.yaml")
    deployment = Deployment(
        "tcp://127.0.0.1:1",
        {"vertical": 1, "horizontal": 2},
        {"vertical": str(path), "horizontal": str(path)},
    )
    return config, deployment


def _sample(version: int, policy: str = "vertical", reward: float = 0.0, group: str = "e/vertical/0") -> Sample:
    return Sample(
        group, "e", "p", "vertical", policy, 0, np.array([1, 5, 6, 7], dtype=np.int32),
        np.array([20], dtype=np.int32), np.array([-3.9], dtype=np.float32), version, reward,
    )  # fmt: skip


def test_samples_of_another_version_are_refused_and_counted(setup):
    config, deployment = setup
    trainer = Trainer(config, deployment, "vertical", ROOT / "runs" / "unused")
    samples = [_sample(0), _sample(1), _sample(0, policy="horizontal"), _sample(0)]
    asyncio.run(trainer.on_message(Groups("vertical", 0, "e", 4, [sample_to_wire(s) for s in samples])))
    assert trainer.received == 4 and trainer.refused == 2 and len(trainer.batch) == 2


def test_a_missing_sample_fails_the_step_loudly(setup):
    config, deployment = setup
    trainer = Trainer(config, deployment, "vertical", ROOT / "runs" / "unused")
    sent = []
    trainer.send = sent.append  # record what would go to the router
    asyncio.run(trainer.on_message(Groups("vertical", 0, "e", 1, [sample_to_wire(_sample(0))])))

    async def step():
        with pytest.raises(RuntimeError, match="received 1 samples, the router forwarded 2"):
            await trainer._step(TrainStep("vertical", 0, 0, 2))

    asyncio.run(step())
    assert sent and "received 1 samples" in sent[-1].error


def test_learner_step_moves_probability_towards_the_better_candidate(setup):
    config, deployment = setup
    learner = PolicyLearner(config, "vertical", deployment.model_paths["vertical"])
    good, bad = 20, 21  # two completions of the same prompt, one rewarded
    samples = []
    for token, reward in [(good, 1.0), (bad, -1.0)] * 4:
        s = _sample(0, reward=reward)
        s.completion_ids = np.array([token], dtype=np.int32)
        samples.append(s)
    from mas_async.trainer.logprobs import completion_logprobs

    def logprob(token):
        import torch

        with torch.no_grad():
            return float(
                completion_logprobs(learner.model, [samples[0].prompt_ids], [np.array([token], dtype=np.int32)])[0][0]
            )

    before = logprob(good) - logprob(bad)
    for s in samples:  # rollout log-probs of the current weights (what an inference server reports)
        s.logprobs = np.array([logprob(int(s.completion_ids[0]))], dtype=np.float32)
    metrics = learner.step(samples)
    assert metrics["logprob_abs_diff"] < 1e-5 and metrics["active_samples"] == 8
    assert logprob(good) - logprob(bad) > before
