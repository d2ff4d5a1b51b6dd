"""Policies sharing one base (`policies.<p>.base`): one hf engine holds the model once and serves each
policy with its own adapters and version, the config refuses what cannot share, and the router's table
routes a guest policy's requests to the base's replicas."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from mas_async.checkpoint import save_policy
from mas_async.config import ConfigError, load_config
from mas_async.inference.backends.base import make_backend
from mas_async.inference.request import GenerationRequest
from mas_async.lora import ADAPTER_DIR, LoraSetup
from mas_async.placement import replica_names
from mas_async.router.hub import expected_peers
from mas_async.router.peers import PeerInfo, PeerTable
from mas_async.tiny_model import materialise
from mas_async.training.learner import PolicyLearner
from mas_async.training.logprobs import completion_logprobs
from mas_async.weights.group import WeightGroupSpec
from mas_async.wire.samples import Sample
from tests.support.paths import ROOT

LORA = "{r: 4, alpha: 8, target_modules: [q_proj, v_proj, up_proj]}"
SHARED = [
    f"policies.vertical.lora={LORA}",
    f"policies.horizontal.lora={LORA}",
    "policies.vertical.lr=0.05",
    "policies.horizontal.lr=0.05",
    "policies.vertical.base=horizontal",
]
PROMPT = [1, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(materialise("builtin:tiny-char", tmp_path_factory.mktemp("models")))


def _config(*overrides):
    return load_config(ROOT / "configs/plan_path_tiny.yaml", [*SHARED, *overrides])


def _trained(model_path, policy, rewards):
    """A learner of `policy` after two steps that push the completions with reward +1."""
    learner = PolicyLearner(_config(), policy, model_path)
    prompt = np.array(PROMPT, dtype=np.int32)
    for _ in range(2):
        samples = []
        for i, (token, reward) in enumerate(zip((20, 21, 22, 23), rewards, strict=True)):
            completion = np.array([token], dtype=np.int32)
            with torch.no_grad():
                lp = completion_logprobs(learner.model, [prompt], [completion])[0].numpy()
            samples.append(
                Sample("e/v/0", "e", "p", policy, policy, 0, prompt, completion, lp, 0, reward, info={"i": i})
            )
        learner.step(samples)
    learner.model.eval()
    return learner


def _served(backend, learner, n=4):
    """(completions of the prompt served by `backend`, max |served - the learner's recompute| of their log-probs)."""
    request = GenerationRequest(prompt_ids=PROMPT, max_tokens=3, temperature=1.0, n=n)
    completions = asyncio.run(backend.generate([request]))[0]
    worst = 0.0
    for c in completions:
        recompute = completion_logprobs(learner.model, [np.array(PROMPT)], [c.token_ids])[0].detach().numpy()
        worst = max(worst, float(np.abs(recompute - c.logprobs).max()))
    return completions, worst


def _backend(model_path, config, guest_adapter=None):
    setup = {p: LoraSetup.of(config.policies[p].lora, model_path) for p in ("horizontal", "vertical")}
    guests = {"vertical": LoraSetup.of(config.policies["vertical"].lora, model_path, guest_adapter)}
    return make_backend(
        "hf", model_path, dtype="float32", max_batch_sequences=8, seed=0, lora=setup["horizontal"], guests=guests
    )


def test_one_engine_serves_each_policy_with_its_own_adapters_and_version(model_path):
    config = _config()
    host_learner = _trained(model_path, "horizontal", (1.0, -1.0, 1.0, -1.0))
    guest_learner = _trained(model_path, "vertical", (-1.0, 1.0, -1.0, 1.0))
    host = _backend(model_path, config)
    guest = host.guest("vertical")
    assert guest.engine is host.engine  # one model, one copy of the base
    host.apply_weights(3, [(n, t.clone()) for n, t in host_learner.named_tensors()])
    guest.apply_weights(5, [(n, t.clone()) for n, t in guest_learner.named_tensors()])
    for _ in range(2):  # in turn: each batch swaps its policy's adapters in
        served, diff = _served(host, host_learner)
        assert diff < 1e-4 and {c.version for c in served} == {3}
        served, diff = _served(guest, guest_learner)
        assert diff < 1e-4 and {c.version for c in served} == {5}
    _, crossed = _served(guest, host_learner)
    assert crossed > 1e-2  # the guest's tokens are not the host's policy's
    with pytest.raises(ValueError, match="serves no guest policy 'nobody'"):
        host.guest("nobody")


def test_a_resumed_guest_serves_the_adapters_of_its_checkpoint(model_path, tmp_path):
    config = _config()
    guest_learner = _trained(model_path, "vertical", (-1.0, 1.0, -1.0, 1.0))
    folder = save_policy(tmp_path, "vertical", 2, guest_learner)
    guest = _backend(model_path, config, guest_adapter=str(folder / ADAPTER_DIR)).guest("vertical")
    _, diff = _served(guest, guest_learner)
    assert diff < 1e-4


def test_guest_adapters_of_another_shape_are_refused(model_path):
    config = _config()
    own = LoraSetup.of(config.policies["horizontal"].lora, model_path)
    other = LoraSetup(8, 8.0, 0.0, own.target_modules, model_path)
    with pytest.raises(ValueError, match="adapters of one shape"):
        make_backend("hf", model_path, dtype="float32", max_batch_sequences=8, seed=0, lora=own, guests={"v": other})
    with pytest.raises(ValueError, match="takes no guests argument"):
        make_backend(f"{__name__}:LoraOnly", model_path, dtype="float32", max_batch_sequences=8, seed=0,
                     lora=own, guests={"v": own})  # fmt: skip


class LoraOnly:
    """A user's backend that serves LoRA but not several policies on one base."""

    def __init__(self, model_path, *, dtype, max_batch_sequences, seed, lora=None):
        self.version = 0


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("policies.vertical.base=nobody", "not one of the policies"),
        ("policies.vertical.base=vertical", "cannot be its own base"),
        ("policies.horizontal.base=vertical", "that policy is served on vertical's servers"),
        ("policies.horizontal.lora=null", "both policies need `lora`"),
        ("policies.vertical.dtype=bfloat16", "dtype differs"),
        ("policies.vertical.model=builtin:small-char", "model differs"),
        ("policies.vertical.replicas=3", "leave it unset"),
        ("policies.vertical.lora={r: 8, alpha: 8, target_modules: [q_proj, v_proj, up_proj]}", "lora.r differs"),
    ],
)
def test_a_base_that_cannot_be_shared_is_refused(override, error):
    with pytest.raises(ConfigError, match=error):
        _config(override)


def test_vllm_cannot_share_a_base():
    with pytest.raises(ConfigError, match="cannot serve several policies' adapters on one base"):
        _config("policies.vertical.backend=vllm", "policies.horizontal.backend=vllm")


def test_the_deployment_has_the_bases_servers_only_and_routes_the_guest_to_them():
    config = _config("policies.horizontal.replicas=2")
    assert config.served_policies("horizontal") == ["horizontal", "vertical"]
    assert config.served_policies("vertical") == [] and config.server_policy("vertical") == "horizontal"
    assert replica_names(config, "vertical") == [] and len(replica_names(config, "horizontal")) == 2
    names = expected_peers(config, training=True)
    assert {n for n in names if n.startswith("inference/")} == {"inference/horizontal/0", "inference/horizontal/1"}
    # evaluation serves each policy alone, from its checkpoint's merged model
    assert "inference/vertical/0" in expected_peers(config, training=False)
    assert WeightGroupSpec.of(config, _deployment(), "vertical").world_size == 3  # its trainer + the 2 servers

    table = PeerTable(names)
    served = tuple(config.served_policies("horizontal"))
    table.join(b"inference/horizontal/0", PeerInfo("inference", "horizontal", 8, 1, policies=served))
    table.join(b"inference/horizontal/1", PeerInfo("inference", "horizontal", 8, 2, policies=served), serving=False)
    assert table.pick_replica("vertical")[0] == b"inference/horizontal/0"
    assert table.of_policy("inference", "vertical") == [b"inference/horizontal/0", b"inference/horizontal/1"]
    assert table.serve(b"inference/horizontal/1", "vertical")  # a replacement, policy by policy
    assert table.routed_replicas("horizontal") == [b"inference/horizontal/0"]
    table.mark_dead(b"inference/horizontal/0")
    assert table.pick_replica("vertical")[0] == b"inference/horizontal/1" and table.pick_replica("horizontal") is None


def _deployment():
    from mas_async.deployment import Deployment

    return Deployment("tcp://127.0.0.1:9", {"vertical": 9, "horizontal": 10}, {})
