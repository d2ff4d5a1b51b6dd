"""The per-policy `device` key: validated in the config, passed to backends that take it, refused by those
that do not, and honoured by the trainer's learner (parameters and flat buffers on that device)."""

from __future__ import annotations

import pytest
import torch

from mas_async.config import ConfigError, load_config
from mas_async.inference.backends.base import make_backend
from tests.support.paths import ROOT

CONFIG = ROOT / "configs" / "plan_path_tiny.yaml"


def test_device_defaults_to_cpu_and_takes_cuda_forms() -> None:
    assert load_config(CONFIG).policies["vertical"].device == "cpu"
    for device in ("cuda", "cuda:1"):
        assert load_config(CONFIG, [f"policies.vertical.device={device}"]).policies["vertical"].device == device


def test_unknown_device_names_the_key() -> None:
    with pytest.raises(ConfigError, match="policies.vertical.device"):
        load_config(CONFIG, ["policies.vertical.device=gpu"])


def test_backend_without_a_device_parameter_is_refused_off_the_cpu(tiny_model) -> None:
    with pytest.raises(ValueError, match="'mock' takes no device"):
        make_backend("mock", str(tiny_model), dtype="float32", max_batch_sequences=4, seed=0, device="cuda")
    make_backend("mock", str(tiny_model), dtype="float32", max_batch_sequences=4, seed=0)  # cpu: unchanged


def test_hf_backend_is_built_on_the_policy_device(tiny_model) -> None:
    backend = make_backend("hf", str(tiny_model), dtype="float32", max_batch_sequences=4, seed=0, device="cpu")
    assert {p.device.type for p in backend.engine.model.parameters()} == {"cpu"}


@pytest.mark.gpu
def test_learner_and_hf_backend_on_cuda(tiny_model) -> None:
    from mas_async.training.learner import PolicyLearner

    config = load_config(CONFIG, [f"policies.vertical.model={tiny_model}", "policies.vertical.device=cuda"])
    learner = PolicyLearner(config, "vertical", str(tiny_model))
    assert {t.device.type for _, t in learner.named_tensors()} == {"cuda"}
    backend = make_backend("hf", str(tiny_model), dtype="float32", max_batch_sequences=4, seed=0, device="cuda")
    assert {p.device.type for p in backend.engine.model.parameters()} == {"cuda"}
    assert torch.cuda.is_available()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_checkpoint_restores_the_random_streams_of_the_learners_device(tiny_model, tmp_path, device) -> None:
    from mas_async.checkpoint import load_policy_state, save_policy
    from mas_async.training.learner import PolicyLearner

    config = load_config(CONFIG, [f"policies.vertical.model={tiny_model}", f"policies.vertical.device={device}"])
    learner = PolicyLearner(config, "vertical", str(tiny_model))
    save_policy(tmp_path, "vertical", 1, learner)
    expected = torch.rand(4, device=device), learner.rng.random()
    load_policy_state(tmp_path, "vertical", 1, learner)
    again = torch.rand(4, device=device), learner.rng.random()
    assert torch.equal(again[0], expected[0]) and again[1] == expected[1]
