"""LoRA adapters (`policies.<p>.lora`): the trainer steps the adapters only, the weight sync's tensors are
the adapters only, an hf server applying them computes the trainer's log-probs, the merge the vLLM
backend does equals peft's, and a checkpoint resumes the same adapters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mas_async.checkpoint import save_policy
from mas_async.config import ConfigError, load_config
from mas_async.inference.backends.base import make_backend
from mas_async.inference.backends.hf import HFBackend
from mas_async.inference.request import GenerationRequest
from mas_async.lora import ADAPTER_DIR, LoraSetup, base_weight_name, merge_adapters, merged_model
from mas_async.tiny_model import materialise
from mas_async.training.learner import PolicyLearner
from mas_async.training.logprobs import completion_logprobs
from mas_async.wire.samples import Sample
from tests.support.paths import ROOT

LORA = [
    "policies.vertical.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj, up_proj]}",
    "policies.vertical.lr=0.05",
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(materialise("builtin:tiny-char", tmp_path_factory.mktemp("models")))


def _config(*overrides):
    return load_config(ROOT / "configs/plan_path_tiny.yaml", [*LORA, *overrides])


def _setup(config, model_path, adapter=None):
    return LoraSetup.of(config.policies["vertical"].lora, model_path, adapter)


def _learner(model_path, *overrides, adapter=None):
    config = _config(*overrides)
    return PolicyLearner(config, "vertical", model_path, adapter=adapter)


def _batch(model, rewards=(1.0, -1.0, 1.0, -1.0), tokens=(20, 21, 22, 23), version=0):
    prompt = np.array([1, 5, 6, 7, 8], dtype=np.int32)
    samples = []
    for i, (token, reward) in enumerate(zip(tokens, rewards, strict=True)):
        completion = np.array([token], dtype=np.int32)
        with torch.no_grad():
            lp = completion_logprobs(model, [prompt], [completion])[0].numpy()
        samples.append(
            Sample("e/v/0", "e", "p", "vertical", "vertical", 0, prompt, completion, lp, version, reward, info={"i": i})
        )
    return samples


def _logprobs(model, ids=(1, 5, 6, 7, 8, 20, 21, 22)):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits.float(), -1)


def test_the_trainer_steps_the_adapters_only_and_sends_them_only(model_path):
    learner = _learner(model_path)
    base = {n: p.detach().clone() for n, p in learner.model.named_parameters() if "lora_" not in n}
    sent = learner.named_tensors()
    assert sent and all(".lora_A." in n or ".lora_B." in n for n, _ in sent)
    assert {base_weight_name(n)[0].rsplit(".", 2)[-2] for n, _ in sent} == {"q_proj", "v_proj", "up_proj"}
    before = [t.clone() for _, t in sent]
    metrics = learner.step(_batch(learner.model))
    assert metrics["optimizer_steps"] >= 1
    assert any(not torch.equal(a, t) for a, (_, t) in zip(before, learner.named_tensors(), strict=True))
    for name, p in learner.model.named_parameters():  # the base is frozen
        if name in base:
            assert torch.equal(p, base[name]), name
    assert learner.full_bytes() > 10 * sum(t.numel() * t.element_size() for _, t in sent)


def test_an_hf_server_applying_the_adapters_computes_the_trainers_logprobs(model_path):
    learner = _learner(model_path)
    config = _config()
    server = HFBackend(model_path, lora=_setup(config, model_path))
    assert [n for n, *_ in server.parameter_manifest()] == [n for n, _ in learner.named_tensors()]
    for _ in range(2):
        learner.step(_batch(learner.model))
    learner.model.eval()
    trained = _logprobs(learner.model)
    assert (trained - _logprobs(server.model)).abs().max() > 1e-3  # the step moved the policy
    server.load_weights([(n, t.clone()) for n, t in learner.named_tensors()])
    assert (trained - _logprobs(server.model)).abs().max() < 1e-5
    # and its generated log-probs are the trainer's recompute
    request = GenerationRequest(prompt_ids=[1, 5, 6, 7, 8], max_tokens=3, temperature=1.0, n=2)
    for completion in server.generate([request])[0]:
        recompute = completion_logprobs(learner.model, [np.array(request.prompt_ids)], [completion.token_ids])[0]
        assert np.abs(recompute.detach().numpy() - completion.logprobs).max() < 1e-4


def test_the_merge_of_the_vllm_backend_equals_peft_s(model_path):
    learner = _learner(model_path)
    learner.step(_batch(learner.model))
    reference = {n: p.detach() for n, p in merged_model(learner.model).named_parameters()}
    base = {n: p.detach() for n, p in learner.model.get_base_model().named_parameters() if "lora_" not in n}
    base = {n.replace(".base_layer.", "."): p for n, p in base.items()}
    merged = merge_adapters(base, learner.named_tensors(), learner.lora.scale, torch.float32)
    assert set(merged) == {n for n in reference if n.endswith(("q_proj.weight", "v_proj.weight", "up_proj.weight"))}
    for name, weight in merged.items():
        assert (weight - reference[name]).abs().max() < 1e-6, name
        assert not torch.equal(weight, base[name])


def test_a_merge_refuses_a_half_pair_and_an_unknown_weight():
    base = {"model.layers.0.mlp.up_proj.weight": torch.zeros(4, 3)}
    a = ("base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight", torch.ones(2, 3))
    b = ("base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight", torch.ones(4, 2))
    assert merge_adapters(base, [a, b], 0.5, torch.float32)["model.layers.0.mlp.up_proj.weight"].eq(1.0).all()
    with pytest.raises(ValueError, match="without its other half"):
        merge_adapters(base, [a], 1.0, torch.float32)
    with pytest.raises(ValueError, match="does not have"):
        merge_adapters({}, [a, b], 1.0, torch.float32)
    with pytest.raises(ValueError, match="not the name of a LoRA"):
        base_weight_name("model.layers.0.mlp.up_proj.weight")


def test_a_checkpoint_holds_the_merged_model_and_resumes_the_adapters(model_path, tmp_path):
    learner = _learner(model_path)
    learner.step(_batch(learner.model))
    folder = save_policy(tmp_path, "vertical", 1, learner)
    assert (folder / ADAPTER_DIR / "adapter_config.json").is_file()
    learner.model.eval()
    expected = _logprobs(learner.model)
    plain = HFBackend(str(folder))  # the merged model folder, served as it is (eval)
    assert (expected - _logprobs(plain.model)).abs().max() < 1e-5
    resumed = _learner(model_path, adapter=str(folder / ADAPTER_DIR))
    assert [n for n, _ in resumed.named_tensors()] == [n for n, _ in learner.named_tensors()]
    for (_, a), (_, b) in zip(resumed.named_tensors(), learner.named_tensors(), strict=True):
        assert torch.equal(a, b)
    assert all(p.requires_grad for _, p in resumed.trained)


def test_lora_config_is_checked():
    with pytest.raises(ConfigError, match="r"):
        _config("policies.vertical.lora={r: 0}")
    with pytest.raises(ConfigError, match="mock backend runs no model"):
        _config("policies.vertical.backend=mock")


def test_a_backend_without_a_lora_parameter_is_refused(model_path):
    with pytest.raises(ValueError, match="takes no lora argument"):
        make_backend(
            "mock", model_path, dtype="float32", max_batch_sequences=4, seed=0, lora=_setup(_config(), model_path)
        )


def test_a_resumed_lora_policy_starts_from_the_base_and_the_checkpoints_adapters(tmp_path):
    from mas_async.deployment import Deployment
    from mas_async.lora import starting_point

    checkpoint = tmp_path / "v000004"
    (checkpoint / ADAPTER_DIR).mkdir(parents=True)
    spec = _config().policies["vertical"].lora
    fresh = Deployment("tcp://127.0.0.1:9", {}, {"vertical": "/models/base"})
    assert starting_point(fresh, "vertical", None) == ("/models/base", None)
    assert starting_point(fresh, "vertical", spec) == ("/models/base", LoraSetup.of(spec, "/models/base"))
    resumed = Deployment(
        "tcp://127.0.0.1:9",
        {},
        {"vertical": "/models/base"},
        start_version=4,
        weights_paths={"vertical": str(checkpoint)},
    )
    assert starting_point(resumed, "vertical", None) == (str(checkpoint), None)  # the merged model, as it is
    path, setup = starting_point(resumed, "vertical", spec)
    assert (path, setup.base, setup.adapter) == ("/models/base", "/models/base", str(checkpoint / ADAPTER_DIR))


def test_a_bf16_vllm_worker_merges_adapters_into_the_float32_base_its_folder_holds(model_path):
    """A bf16 engine with LoRA: the worker's reload gets, for every adapted weight, bf16(W + delta) with W
    the float32 weight of the model folder, i.e. what a bf16 engine loading the merged float32 model would
    hold. A base rounded to bf16 before the merge would drop a 2e-6 delta from every entry (the bf16 step
    at ~0.02 is 1.2e-4): the served model would never move. vLLM's worker is faked (its config and
    `reload_weights`); the code under test is the worker extension's own (`mas_use_lora`, `_mas_reload`)."""
    import json
    from dataclasses import asdict
    from pathlib import Path
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from mas_async.inference.backends.vllm_compat import WeightSyncExtension

    class Worker(WeightSyncExtension):
        def __init__(self) -> None:
            tied = json.loads((Path(model_path) / "config.json").read_text()).get("tie_word_embeddings", False)
            config = SimpleNamespace(dtype=torch.bfloat16, model=model_path, hf_text_config=SimpleNamespace(
                tie_word_embeddings=tied))  # fmt: skip
            self.vllm_config = SimpleNamespace(model_config=config)
            self.loaded: dict[str, torch.Tensor] = {}

        def reload_weights(self, weights_iterator, is_checkpoint_format: bool) -> None:
            assert is_checkpoint_format
            self.loaded = dict(weights_iterator)

        def _mas_refresh_tied_lm_head(self) -> None:  # the engine's own model: nothing here
            pass

    folder = {}
    for path in sorted(Path(model_path).glob("*.safetensors")):
        folder.update(load_file(str(path)))
    setup = LoraSetup(r=4, alpha=8.0, dropout=0.0, target_modules=("up_proj",), base=model_path)
    worker = Worker()
    worker.mas_use_lora(asdict(setup))
    delta = 2e-6
    adapters = []
    for name, w in folder.items():
        if name.endswith("up_proj.weight"):
            prefix = "base_model.model." + name.removesuffix(".weight")
            a = torch.full((setup.r, w.shape[1]), 1.0)  # scale * B @ A = 2 * 4 * b * 1 = delta everywhere
            b = torch.full((w.shape[0], setup.r), delta / (setup.scale * setup.r))
            adapters += [(f"{prefix}.lora_A.default.weight", a), (f"{prefix}.lora_B.default.weight", b)]
    worker._mas_reload(adapters)

    adapted = [n for n in folder if n.endswith("up_proj.weight")]
    assert adapted and set(worker.loaded) == set(folder) - ({"lm_head.weight"} if "lm_head.weight" not in
                                                             worker.loaded else set())  # fmt: skip
    for name, served in worker.loaded.items():
        w = folder[name]
        assert w.dtype == torch.float32 and served.dtype == torch.bfloat16
        expected = (w + delta).to(torch.bfloat16) if name in adapted else w.to(torch.bfloat16)
        assert torch.equal(served, expected), name
    moved = torch.cat([(worker.loaded[n].float() - folder[n].to(torch.bfloat16).float()).flatten() for n in adapted])
    # Each entry moves by a whole bf16 step or not at all; on average by the delta itself.
    assert moved.ne(0).any() and abs(float(moved.mean()) - delta) < 0.25 * delta
