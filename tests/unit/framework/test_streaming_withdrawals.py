"""Withdrawals from a streamed step (`StreamingStep.withdraw`, training/streaming.py), through the Trainer's own
messages where the Trainer takes part: a withdrawn sample is named by what it is (episode, attempt, group,
index), never by its address, so the retry's samples that CPython puts where the withdrawn ones were train
once each; the step checks that it computed exactly the samples it was given and not withdrawn (a named
error, not an assert that `python -O` drops); and a streamed sample of another version or policy is refused
and counted as the batch step's are."""

from __future__ import annotations

import asyncio
import gc
import threading

import numpy as np
import pytest

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.tiny_model import materialise
from mas_async.training.streaming import StreamedStepError
from mas_async.wire.messages import Groups, TrainStep, Withdrawn, sample_to_wire
from mas_async.wire.samples import Sample
from tests.support.paths import ROOT
from tests.unit.framework.test_trainer_rule import _stepping_trainer

AGENTS = ("vertical", "horizontal")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = str(materialise("builtin:tiny-char", tmp_path_factory.mktemp("models")))
    config = load_config(ROOT / "configs/plan_path_tiny.yaml")
    assert config.streams_turns()  # the default: tree sampling, agent_turn, std_scope group
    return config, Deployment("tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 2}, dict.fromkeys(AGENTS, path))


def _group(episode: int, turn: int, attempt: int = 0, versions=(0, 0, 0, 0), policies=("vertical",) * 4) -> Groups:
    """Episode `episode`'s group of agent vertical at `turn` (4 candidates), as its attempt's Groups."""
    samples = [
        Sample(f"train0-{episode}/vertical/{turn}", f"train0-{episode}", f"p{episode}", "vertical", policy, turn,
               np.array([1, 5, 6, 7 + turn], dtype=np.int32), np.array([20 + i], dtype=np.int32),
               np.array([-3.4], dtype=np.float32), version, float(i))
        for i, (version, policy) in enumerate(zip(versions, policies, strict=True))
    ]  # fmt: skip
    return Groups("vertical", 0, f"train0-{episode}", attempt, 4, 20, [sample_to_wire(s) for s in samples], 1)


def test_the_retry_s_samples_train_once_where_the_freed_withdrawn_ones_were(setup):
    """Episode 1's turn-0 group is computed; the pass thread is busy, so its turn-1 group waits; the router
    withdraws attempt 0 (its worker was lost), which drops the waiting group, and nothing refers to its samples
    any more: they are freed (and garbage collected). The retry's samples, decoded next, take their addresses.
    The step computes again from weights v (a computed sample was withdrawn) and trains episode 0's and the
    retry's samples, each once, and no sample of attempt 0."""
    trainer, sent = _stepping_trainer(setup, lambda: None)
    # Every message is made before the withdrawal: the next samples made after it are the trainer's own,
    # decoded from the retry's Groups.
    first = [_group(0, 0), _group(1, 0), _group(0, 1)]
    waiting = _group(1, 1)
    retry = [_group(1, 0, attempt=1), _group(1, 1, attempt=1)]
    busy = threading.Event()

    async def run() -> tuple[set[int], set[int]]:
        for message in first:
            await trainer.on_message(message)
        stream = trainer.stream
        assert stream is not None
        await stream.drain()  # episode 1's turn 0 is computed
        stream._thread.submit(busy.wait)  # the one compute thread is busy: the next group waits for it
        await trainer.on_message(waiting)
        lost = trainer.attempts[0][("train0-1", 0)]
        freed = {id(s) for s in lost if s.turn == 1}  # (ints: no reference to the samples is kept)
        del lost
        assert len(freed) == 4
        await trainer.on_message(Withdrawn("vertical", 0, "train0-1", 0))
        gc.collect()
        for message in retry:
            await trainer.on_message(message)
        reused = freed & {id(s) for s in trainer.buffers[0]}
        busy.set()
        await trainer._step(TrainStep("vertical", 0, 0, 16))
        keys = sorted((key.episode_id, key.attempt, key.group, key.index) for key in stream.keys)
        assert keys == sorted(
            (f"train0-{episode}", attempt, f"train0-{episode}/vertical/{turn}", index)
            for episode, attempt in ((0, 0), (1, 1))
            for turn in (0, 1)
            for index in range(4)
        )
        return freed, reused

    freed, reused = asyncio.run(run())
    # What made the old step (which named withdrawn samples by id()) drop valid samples: the retry's samples
    # took addresses of the withdrawn ones, as CPython's allocator usually makes them do here (it is not promised:
    # the next test makes the addresses the same on purpose).
    assert len(freed) == 4 and len(reused) <= 4
    metrics = sent[-1].metrics
    assert not sent[-1].error and sent[-1].version == 1
    assert metrics["samples"] == 16 and metrics["version_mismatch"] == 0
    assert metrics["episodes"] == 2 and metrics["repeated_episodes"] == 0


def test_a_retry_whose_samples_sit_at_the_withdrawn_ones_addresses_trains_them_once(setup):
    """The withdrawn attempt's turn-1 samples and the retry's are the very same objects, so every address
    (`id()`) of the retry is one the step saw withdrawn: a step that names samples by address drops the retry's
    valid samples (or fails its check); a step that names them by (episode, attempt, group, index) trains each
    given sample of the retry once."""
    from mas_async.training.learner import PolicyLearner
    from mas_async.training.streaming import StreamingStep
    from mas_async.wire.messages import samples_from_wire

    config, deployment = setup
    learner = PolicyLearner(config, "vertical", deployment.model_paths["vertical"])
    turn0, turn1 = samples_from_wire(_group(1, 0).samples), samples_from_wire(_group(1, 1).samples)
    other = samples_from_wire(_group(0, 0).samples)

    async def run() -> dict:
        step = StreamingStep(learner, 0)
        step.add(other, "train0-0", 1)
        step.add(turn0, "train0-1", 1)
        await step.drain()  # episode 1's turn 0 is computed by a pass
        step.add(turn1, "train0-1", 1)
        await step.drain()
        assert step.withdraw("train0-1", 0) == 8
        step.add(turn0, "train0-1", 1, attempt=1)  # the same objects, the same addresses, another attempt
        step.add(turn1, "train0-1", 1, attempt=1)
        metrics = await step.finish()
        assert sorted((k.episode_id, k.attempt) for k in step.keys) == [("train0-0", 0)] * 4 + [("train0-1", 1)] * 8
        return metrics

    assert asyncio.run(run())["samples"] == 12


def test_a_streamed_sample_of_another_version_or_policy_is_refused_and_counted(setup):
    """Strict mode's rule holds for the streamed step as for the batch step: of a Groups message with one
    sample of version 1 and one of another policy, the step computes the other two (and another group's
    four), and the two refused ones are `version_mismatch`, reported with the step, never trained."""
    trainer, sent = _stepping_trainer(setup, lambda: None)
    assert trainer.streams

    async def run() -> None:
        await trainer.on_message(_group(0, 0))
        await trainer.on_message(_group(1, 0, versions=(0, 1, 0, 0), policies=("vertical", "vertical", "horizontal",
                                                                                  "vertical")))  # fmt: skip
        assert trainer.stream is not None and trainer.stream.given == 6
        await trainer.stream.drain()
        assert {s.version for s in trainer.stream.samples} == {0} and len(trainer.stream.samples) == 6
        await trainer._step(TrainStep("vertical", 0, 0, 8))

    asyncio.run(run())
    metrics = sent[-1].metrics
    assert not sent[-1].error and metrics["samples"] == 6 and metrics["version_mismatch"] == 2


def test_the_step_refuses_a_sample_of_another_version_and_checks_what_it_computed(setup):
    """The step's own checks, named errors (an assert would be gone under `python -O`): a sample of another
    version given to it, and a sample given that no pass computed."""
    from mas_async.training.learner import PolicyLearner
    from mas_async.training.streaming import StreamingStep
    from mas_async.wire.messages import samples_from_wire

    config, deployment = setup
    learner = PolicyLearner(config, "vertical", deployment.model_paths["vertical"])
    step = StreamingStep(learner, 0)
    with pytest.raises(StreamedStepError, match=r"given samples of versions \[1\]"):
        step.add(samples_from_wire(_group(0, 0, versions=(0, 0, 1, 0)).samples), "train0-0", 1)
    assert step.given == 0

    async def lost_in_the_step() -> None:
        step = StreamingStep(learner, 0)
        step.add(samples_from_wire(_group(0, 0).samples), "train0-0", 1)
        step.add(samples_from_wire(_group(1, 0).samples), "train0-1", 1)
        await step.drain()
        step.keys.pop()  # (as if a pass had lost a sample)
        with pytest.raises(StreamedStepError, match=r"computed 7 samples, but was given 8 .* 1 given were never"):
            await step.finish()

    asyncio.run(lost_in_the_step())
