"""The learner in bounded-staleness mode: on fresh samples it makes the strict mode's update; the
rollout log-probs of older samples are checked under the kept weights of the version that generated
them (and the check fails when those weights are wrong); the check leaves the current weights intact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mas_async.config import load_config
from mas_async.tiny_model import materialise
from mas_async.training.learner import PolicyLearner
from mas_async.training.logprobs import completion_logprobs
from mas_async.wire.samples import Sample
from tests.support.paths import ROOT


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(materialise("builtin:tiny-char", tmp_path_factory.mktemp("models")))


def _learner(model_path, *overrides):
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["policies.vertical.lr=0.01", *overrides])
    return PolicyLearner(config, "vertical", model_path)


def _batch(learner, version, group="e/vertical/0", rewards=(1.0, -1.0, 1.0, -1.0), tokens=(20, 21, 22, 23)):
    """Samples as an inference server holding the learner's current weights as `version` reports them."""
    prompt = np.array([1, 5, 6, 7, 8], dtype=np.int32)
    samples = []
    for token, reward in zip(tokens, rewards, strict=True):
        completion = np.array([token], dtype=np.int32)
        with torch.no_grad():
            lp = completion_logprobs(learner.model, [prompt], [completion])[0].numpy()
        samples.append(Sample(group, "e", "p", "vertical", "vertical", 0, prompt, completion, lp, version, reward))
    return samples


def _as_recomputed(learner, samples):
    """Rollout log-probs bit-equal to the learner's own recompute (a server's differ by float noise,
    ~1e-7, which Adam's first step amplifies on parameters whose gradient is near its eps)."""
    with torch.no_grad():
        for sample, lp in zip(samples, learner._logprobs(learner.model, samples), strict=True):
            sample.logprobs = lp.numpy()
    return samples


def test_fresh_samples_get_exactly_the_strict_update(model_path):
    strict = _learner(model_path)
    stale = _learner(model_path, "rollout.max_staleness=1", "algorithm.off_policy=decoupled")
    stale.keep_weights(0)
    strict.step(_as_recomputed(strict, _batch(strict, 0)), 0)
    metrics = stale.step(_as_recomputed(stale, _batch(stale, 0)), 0)
    for (name, a), (_, b) in zip(strict.model.named_parameters(), stale.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert metrics["staleness_max"] == 0 and metrics["is_weight_mean"] == 1.0


def test_stale_samples_are_checked_under_the_weights_that_generated_them(model_path):
    learner = _learner(model_path, "rollout.max_staleness=1")
    learner.keep_weights(0)
    old = _batch(learner, 0, group="a/vertical/0")
    learner.step(_batch(learner, 0, group="b/vertical/0"), 0)
    learner.keep_weights(1)
    fresh = _batch(learner, 1, group="c/vertical/0")
    current = [b.clone() for b in learner.flat]
    diffs, unchecked = learner._stale_check(old + fresh, 1)
    assert len(diffs) == 4 and unchecked == 0  # trainer.stale_check_samples = 4 of version 0
    assert max(float(d.max()) for d in diffs) < 1e-5
    assert all(torch.equal(a, b) for a, b in zip(current, learner.flat, strict=True))  # weights restored

    # The proof can fail: checked against the wrong weights, the old samples' log-probs differ.
    learner.snapshots[0] = learner.snapshots[1]
    wrong, _ = learner._stale_check(old, 1)
    assert max(float(d.max()) for d in wrong) > 1e-3

    learner.snapshots[0] = None  # no kept weights (e.g. generated before a resume): counted, not checked
    del learner.snapshots[0]
    assert learner._stale_check(old, 1) == ([], 4)


def test_a_stale_step_reports_staleness_and_the_proof_under_the_generating_weights(model_path):
    learner = _learner(model_path, "rollout.max_staleness=1")
    learner.keep_weights(0)
    old = _batch(learner, 0, group="a/vertical/0")
    learner.step(_batch(learner, 0, group="b/vertical/0"), 0)
    learner.keep_weights(1)
    metrics = learner.step(old + _batch(learner, 1, group="c/vertical/0"), 1)
    assert metrics["staleness_mean"] == 0.5 and metrics["staleness_max"] == 1 and metrics["stale_samples"] == 4
    assert metrics["stale_checked_samples"] == 4 and metrics["logprob_abs_diff"] < 1e-5
    assert metrics["is_weight_max"] > 1.0 or metrics["is_weight_mean"] != 1.0  # the old samples are off-policy


def test_old_weights_beyond_the_window_are_not_kept(model_path):
    learner = _learner(model_path, "rollout.max_staleness=2")
    for version in range(5):
        learner.keep_weights(version)
    assert sorted(learner.snapshots) == [2, 3, 4]
    strict = _learner(model_path)
    strict.keep_weights(0)
    assert strict.snapshots == {}
