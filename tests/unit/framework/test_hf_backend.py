"""The transformers backend: batching, left padding, stop tokens, log-probs and weight loading."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mas_async.inference.backends.hf import HFBackend
from mas_async.inference.request import GenerationRequest
from mas_async.tiny_model import materialise
from mas_async.training.logprobs import completion_logprobs
from tests.support.hf_backend import PROMPTS, prompt_ids, sharp_backend


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialise("builtin:tiny-char", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def backend(model_dir: Path) -> HFBackend:
    return sharp_backend(model_dir)


def test_batched_greedy_equals_unbatched_with_left_padding(backend: HFBackend) -> None:
    alone = [backend.generate([GenerationRequest(p, n=1, max_tokens=16, greedy=True)])[0][0] for p in PROMPTS]
    batched = backend.generate([GenerationRequest(p, n=2, max_tokens=16, greedy=True) for p in PROMPTS])
    assert [len(group) for group in batched] == [2, 2, 2]
    assert len({tuple(c.token_ids) for c in alone}) > 1  # the prompts lead to different outputs
    for single, group in zip(alone, batched, strict=True):
        assert single.token_ids.dtype == np.int32 and single.logprobs.dtype == np.float32
        assert len(set(single.token_ids.tolist())) > 1  # not one token repeated
        for completion in group:
            np.testing.assert_array_equal(completion.token_ids, single.token_ids)
            np.testing.assert_allclose(completion.logprobs, single.logprobs, atol=1e-5)
            assert completion.finish_reason == "length" and len(completion.token_ids) == 16


def test_prompts_with_a_common_first_part_read_it_once_and_generate_as_alone(backend: HFBackend, monkeypatch) -> None:
    head = prompt_ids(20, 5)
    prompts = [np.concatenate([head, prompt_ids(n, 10 + n)]).astype(np.int32) for n in (2, 9, 5)]
    alone = [backend.generate([GenerationRequest(p, n=1, max_tokens=12, greedy=True)])[0][0] for p in prompts]
    calls = []
    forward = backend.model.forward
    monkeypatch.setattr(
        backend.model, "forward", lambda *a, **kw: calls.append(tuple(kw["input_ids"].shape)) or forward(*a, **kw)
    )
    batched = backend.generate([GenerationRequest(p, n=2, max_tokens=12, greedy=True) for p in prompts])
    assert calls[:3] == [(1, 20), (3, 9), (6, 1)]  # the common part once, each prompt's rest once, then decode
    assert len({tuple(c.token_ids) for c in alone}) > 1
    for single, group in zip(alone, batched, strict=True):
        for completion in group:
            np.testing.assert_array_equal(completion.token_ids, single.token_ids)
            np.testing.assert_allclose(completion.logprobs, single.logprobs, atol=1e-5)


def test_chunked_batches_give_the_same_result(backend: HFBackend, model_dir: Path) -> None:
    small = HFBackend(model_dir, max_batch_sequences=2)
    small.load_weights([(n, p.detach().clone()) for n, p in backend.model.named_parameters()])
    requests = [GenerationRequest(p, n=3, max_tokens=8, greedy=True) for p in PROMPTS]
    for ours, theirs in zip(small.generate(requests), backend.generate(requests), strict=True):
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_array_equal(a.token_ids, b.token_ids)


def test_stop_token_ends_the_sequence_and_is_included(backend: HFBackend) -> None:
    full = backend.generate([GenerationRequest(PROMPTS[1], max_tokens=16, greedy=True)])[0][0].token_ids
    stop = int(full[5])
    first = full.tolist().index(stop)
    cut = backend.generate([GenerationRequest(PROMPTS[1], max_tokens=16, greedy=True, stop_token_ids=[stop])])[0][0]
    np.testing.assert_array_equal(cut.token_ids, full[: first + 1])
    assert cut.finish_reason == "stop"

    stops = [7, 8, 9, 10, 11]
    sampled = backend.generate([GenerationRequest(p, n=8, max_tokens=12, stop_token_ids=stops) for p in PROMPTS])
    reasons = set()
    for completion in (c for group in sampled for c in group):
        ids = completion.token_ids.tolist()
        assert not set(ids[:-1]) & set(stops)
        reasons.add(completion.finish_reason)
        if completion.finish_reason == "stop":
            assert ids[-1] in stops
        else:
            assert len(ids) == 12
    assert reasons == {"stop", "length"}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_logprobs_match_the_trainer(backend: HFBackend, temperature: float) -> None:
    requests = [GenerationRequest(p, n=4, max_tokens=20, temperature=temperature) for p in PROMPTS]
    completions = [c for group in backend.generate(requests) for c in group]
    prompts = [p for p in PROMPTS for _ in range(4)]
    with torch.no_grad():
        recomputed = completion_logprobs(backend.model, prompts, [c.token_ids for c in completions], temperature)
    diffs = np.concatenate([np.abs(r.numpy() - c.logprobs) for r, c in zip(recomputed, completions, strict=True)])
    assert diffs.mean() < 1e-5
    assert len({tuple(c.token_ids) for c in completions}) > 4  # samples differ


def test_greedy_logprobs_match_the_trainer(backend: HFBackend) -> None:
    completions = [g[0] for g in backend.generate([GenerationRequest(p, max_tokens=10, greedy=True) for p in PROMPTS])]
    recomputed = completion_logprobs(backend.model, PROMPTS, [c.token_ids for c in completions])
    for r, c in zip(recomputed, completions, strict=True):
        assert r.requires_grad  # gradients flow when grad mode is on
        np.testing.assert_allclose(r.detach().numpy(), c.logprobs, atol=1e-5)


def test_completions_carry_the_version(backend: HFBackend) -> None:
    backend.version = 7
    try:
        result = backend.generate([GenerationRequest(PROMPTS[0], n=2, max_tokens=2)])
    finally:
        backend.version = 0
    assert [c.version for c in result[0]] == [7, 7]


def test_parameter_manifest_lists_tied_weights_once(backend: HFBackend) -> None:
    manifest = backend.parameter_manifest()
    names = [name for name, _, _ in manifest]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(names))
    assert ("model.embed_tokens.weight", [51, 64], "float32") in manifest


def test_load_weights_mismatch_leaves_the_model_untouched(backend: HFBackend) -> None:
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    good = [(n, torch.zeros_like(p)) for n, p in before.items()]
    last = good[-1][0]
    cases = {
        "wrong shape": (good[:-1] + [(last, torch.zeros(3))], last),
        "wrong dtype": (good[:-1] + [(last, good[-1][1].double())], last),
        "unknown name": (good + [("model.extra.weight", torch.zeros(1))], "model.extra.weight"),
        "missing name": (good[:-1], last),
    }
    for case, (tensors, named) in cases.items():
        with pytest.raises(ValueError, match=named.replace(".", r"\.")):
            backend.load_weights(tensors)
        for n, p in backend.model.named_parameters():
            assert torch.equal(p, before[n]), case


def test_invalid_requests_are_explained(backend: HFBackend) -> None:
    with pytest.raises(ValueError, match="request 1.*empty"):
        backend.generate([GenerationRequest(PROMPTS[0]), GenerationRequest(np.zeros(0, dtype=np.int32))])
    with pytest.raises(ValueError, match="512 positions"):
        backend.generate([GenerationRequest(PROMPTS[0], max_tokens=600)])
    with pytest.raises(ValueError, match="dtype"):
        HFBackend(backend.model.name_or_path, dtype="int8")
