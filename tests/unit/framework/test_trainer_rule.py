"""The trainer's version rule: strict mode refuses and counts samples of any other weight version;
bounded staleness accepts v-k..v, drops and counts older ones and refuses newer ones; samples wait for
the step of their iteration; a TrainStep whose sample count differs from what the router forwarded is an
error."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.tiny_model import materialise
from mas_async.training.learner import PolicyLearner
from mas_async.training.publisher import WeightPublisher
from mas_async.training.trainer import Trainer
from mas_async.weights.group import WeightGroupSpec
from mas_async.wire.messages import Groups, TrainStep, sample_to_wire
from mas_async.wire.samples import Sample
from tests.support.paths import ROOT


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


def _trainer(setup, *overrides: str) -> Trainer:
    config, deployment = setup
    if overrides:
        config = load_config(ROOT / "configs/plan_path_tiny.yaml", list(overrides))
    return Trainer(config, deployment, "vertical", ROOT / "runs" / "unused")


def test_samples_of_another_version_or_policy_are_refused_and_counted(setup):
    trainer = _trainer(setup)
    samples = [_sample(0), _sample(1), _sample(0, policy="horizontal"), _sample(0)]
    asyncio.run(trainer.on_message(Groups("vertical", 0, "e", 0, 4, 0, [sample_to_wire(s) for s in samples])))
    assert len(trainer.buffers[0]) == 4  # buffered by iteration; the rule is applied by the step
    accepted, mismatch, stale = trainer.admit(trainer.buffers[0], 0)
    assert [s.version for s in accepted] == [0, 0] and mismatch == 2 and stale == 0


def test_strict_samples_of_an_older_version_are_a_mismatch(setup):
    trainer = _trainer(setup)
    accepted, mismatch, stale = trainer.admit([_sample(2), _sample(0), _sample(3), _sample(4)], 3)
    assert [s.version for s in accepted] == [3] and mismatch == 3 and stale == 0


def test_stale_mode_accepts_the_window_drops_older_and_refuses_newer(setup):
    trainer = _trainer(setup, "rollout.max_staleness=2")
    versions = [0, 1, 2, 3, 4, 5, 1]
    accepted, mismatch, stale = trainer.admit([_sample(v) for v in versions], 3)
    assert sorted(s.version for s in accepted) == [1, 1, 2, 3]
    assert stale == 1 and mismatch == 2  # v0 is older than 3 - 2; v4, v5 are weights not yet trained


class _RecordingSender:
    """Stands in for the weight broadcast; calls `during` while "sending" (samples arriving meanwhile)."""

    def __init__(self, during) -> None:
        self.during, self.versions = during, []

    def send(self, version, named_tensors):
        self.versions.append(version)
        self.during()
        return {"seconds": 0.0, "bytes": 0}


def _stepping_trainer(setup, during):
    config, deployment = setup
    trainer = Trainer(config, deployment, "vertical", ROOT / "runs" / "unused")
    trainer.learner.step = lambda batch, version: {"samples": len(batch)}
    sent = []
    trainer.send = sent.append
    spec = WeightGroupSpec.of(config, deployment, "vertical")
    trainer.publisher = WeightPublisher(spec, 1 << 20, trainer.send)
    trainer.publisher.sender = _RecordingSender(during)
    trainer.publisher.generation = 0  # as if main() joined the weight group's first generation
    trainer._group_ready.set()
    return trainer, sent


def test_samples_of_the_next_iteration_arriving_during_a_step_are_kept_for_their_own_step(setup):
    holder = {}
    trainer, sent = _stepping_trainer(setup, lambda: holder["t"].receive([_sample(1), _sample(1)], iteration=1))
    holder["t"] = trainer
    trainer.receive([_sample(0)] * 3, iteration=0)
    asyncio.run(trainer._step(TrainStep("vertical", 0, 0, 3)))
    assert sent[-1].version == 1 and sent[-1].metrics["samples"] == 3 and sent[-1].metrics["version_mismatch"] == 0
    assert len(trainer.buffers[1]) == 2  # not wiped by the step of v0
    asyncio.run(trainer._step(TrainStep("vertical", 1, 1, 2)))
    assert sent[-1].version == 2 and sent[-1].metrics["samples"] == 2


def test_samples_arriving_after_their_step_are_reported_with_the_next_step_not_kept(setup):
    holder = {}
    trainer, sent = _stepping_trainer(setup, lambda: holder["t"].receive([_sample(0)], iteration=0))
    holder["t"] = trainer
    trainer.receive([_sample(0)] * 2, iteration=0)
    asyncio.run(trainer._step(TrainStep("vertical", 0, 0, 2)))
    assert sent[-1].metrics["version_mismatch"] == 0 and trainer.late == 1 and 0 not in trainer.buffers
    trainer.receive([_sample(1)], iteration=1)
    trainer.publisher.sender.during = lambda: None
    asyncio.run(trainer._step(TrainStep("vertical", 1, 1, 1)))
    assert sent[-1].metrics["version_mismatch"] == 1


def test_a_step_whose_every_sample_was_refused_is_an_error(setup):
    trainer, sent = _stepping_trainer(setup, lambda: None)
    trainer.receive([_sample(5), _sample(0, policy="horizontal")], iteration=0)

    async def step():
        with pytest.raises(RuntimeError, match="every one of the 2 samples"):
            await trainer._step(TrainStep("vertical", 0, 0, 2))

    asyncio.run(step())
    assert sent and "refused" in sent[-1].error


def test_a_step_without_samples_is_counted_and_keeps_the_weights_in_lockstep(setup):
    trainer, sent = _stepping_trainer(setup, lambda: None)
    asyncio.run(trainer._step(TrainStep("vertical", 0, 0, 0)))
    assert sent[-1].version == 1 and sent[-1].metrics["empty_steps"] == 1 and not sent[-1].error


def test_a_missing_sample_fails_the_step_loudly(setup):
    config, deployment = setup
    trainer = Trainer(config, deployment, "vertical", ROOT / "runs" / "unused")
    sent = []
    trainer.send = sent.append  # record what would go to the router
    asyncio.run(trainer.on_message(Groups("vertical", 0, "e", 0, 1, 0, [sample_to_wire(_sample(0))])))

    async def step():
        with pytest.raises(RuntimeError, match="received 1 samples of iteration 0, the router forwarded 2"):
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
    from mas_async.training.logprobs import completion_logprobs

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
    assert metrics["active_samples"] == 8
    assert logprob(good) - logprob(bad) > before


def test_the_trainer_counts_episodes_by_id_and_any_that_came_twice(setup):
    """Each episode's groups of a policy come in one message: a second one (an episode run or forwarded
    twice) is counted, which the fault tests check in every row."""
    trainer, sent = _stepping_trainer(setup, lambda: None)
    for episode in ("train0-0", "train0-1", "train0-1"):
        groups = Groups("vertical", 0, episode, 0, 1, 5, [sample_to_wire(_sample(0))])
        asyncio.run(trainer.on_message(groups))
    asyncio.run(trainer._step(TrainStep("vertical", 0, 0, 3)))
    assert sent[-1].metrics["episodes"] == 2 and sent[-1].metrics["repeated_episodes"] == 1
