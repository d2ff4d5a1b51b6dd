"""The transformers backend's per-request seed and top-k alternatives (the gateway's `seed` and
`top_logprobs`): a seeded request samples the same tokens whatever it is batched with, its n samples
follow vLLM's seed + i rule, and the alternatives are the k most likely tokens of the distribution each
token was sampled from, computed directly from the model; a request asking for neither costs nothing extra
and the mock engine repeats itself given a seed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mas_async.inference.backends import hf
from mas_async.inference.backends.hf import HFBackend
from mas_async.inference.backends.mock import MockEngine
from mas_async.inference.request import GenerationRequest
from mas_async.tiny_model import materialise
from tests.support.hf_backend import PROMPTS, sharp_backend


def _ids(completions) -> list[list[int]]:
    return [c.token_ids.tolist() for c in completions]


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> HFBackend:
    return sharp_backend(materialise("builtin:tiny-char", tmp_path_factory.mktemp("models")))


def test_a_seeded_request_samples_the_same_tokens_alone_and_in_any_batch(backend: HFBackend) -> None:
    seeded = GenerationRequest(PROMPTS[1], n=3, max_tokens=16, seed=1234)
    alone = backend.generate([seeded])[0]
    again = backend.generate([seeded])[0]
    batched = backend.generate(
        [
            GenerationRequest(PROMPTS[0], n=2, max_tokens=16),  # draws from the backend's generator
            GenerationRequest(PROMPTS[2], n=2, max_tokens=5, seed=99),
            seeded,
            GenerationRequest(PROMPTS[1], n=2, max_tokens=16, greedy=True),
            GenerationRequest(PROMPTS[1], n=1, max_tokens=16, temperature=0.7),
        ]
    )[2]
    assert _ids(again) == _ids(alone) and _ids(batched) == _ids(alone)
    for a, b in zip(alone, batched, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)  # (padding moves the logits by ~1e-5)
    assert len({tuple(ids) for ids in _ids(alone)}) == 3  # the n choices differ from each other


def test_sample_i_of_a_seeded_request_is_seeded_with_seed_plus_i_and_other_seeds_differ(backend: HFBackend) -> None:
    three = backend.generate([GenerationRequest(PROMPTS[2], n=3, max_tokens=12, seed=50)])[0]
    shifted = backend.generate([GenerationRequest(PROMPTS[2], n=2, max_tokens=12, seed=51)])[0]
    assert _ids(shifted) == _ids(three)[1:]  # vLLM's rule: sample i of seed s draws as sample 0 of seed s + i
    other = backend.generate([GenerationRequest(PROMPTS[2], n=3, max_tokens=12, seed=7)])[0]
    assert not set(map(tuple, _ids(other))) & set(map(tuple, _ids(three)))


def test_unseeded_requests_still_draw_from_the_backends_generator(backend: HFBackend) -> None:
    request = GenerationRequest(PROMPTS[1], n=4, max_tokens=16)
    backend.generator.manual_seed(3)
    first = backend.generate([request])[0]
    backend.generator.manual_seed(3)
    repeated = backend.generate([request])[0]
    following = backend.generate([request])[0]
    assert _ids(repeated) == _ids(first) and _ids(following) != _ids(first)


def _direct_alternatives(backend: HFBackend, prompt: np.ndarray, ids: np.ndarray, temperature: float, k: int):
    """The k most likely next tokens of every position of `ids` after `prompt`, and their log-probs at
    `temperature`, from one forward pass of the model over the whole sequence."""
    sequence = torch.from_numpy(np.concatenate([prompt, ids]).astype(np.int64))[None]
    with torch.no_grad():
        logits = backend.model(input_ids=sequence).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1).topk(k, dim=-1)


@pytest.mark.parametrize(("temperature", "greedy"), [(1.0, False), (0.7, False), (1.0, True)])
def test_alternatives_are_the_top_k_of_the_distribution_each_token_was_sampled_from(
    backend: HFBackend, temperature: float, greedy: bool
) -> None:
    k = 5
    requests = [
        GenerationRequest(p, n=2, max_tokens=12, temperature=temperature, greedy=greedy, top_logprobs=k)
        for p in PROMPTS
    ]
    in_top = 0
    for prompt, group in zip(PROMPTS, backend.generate(requests), strict=True):
        for completion in group:
            assert completion.top_ids.shape == completion.top_logprobs.shape == (len(completion.token_ids), k)
            assert completion.top_ids.dtype == np.int32 and completion.top_logprobs.dtype == np.float32
            values, ids = _direct_alternatives(backend, prompt, completion.token_ids, temperature, k)
            np.testing.assert_array_equal(completion.top_ids, ids.numpy())
            np.testing.assert_allclose(completion.top_logprobs, values.numpy(), atol=1e-4)
            assert (np.diff(completion.top_logprobs, axis=1) <= 0).all()  # most likely first
            for t, token in enumerate(completion.token_ids.tolist()):
                row = completion.top_ids[t].tolist()
                if token in row:  # the sampled token's log-prob is its entry among the alternatives
                    in_top += 1
                    assert completion.logprobs[t] == pytest.approx(
                        completion.top_logprobs[t, row.index(token)], abs=1e-6
                    )
                else:
                    assert completion.logprobs[t] <= completion.top_logprobs[t, -1] + 1e-6
    assert in_top > 0


def test_each_request_gets_its_own_number_of_alternatives_and_none_when_it_asks_for_none(
    backend: HFBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = backend.generate(
        [
            GenerationRequest(PROMPTS[0], n=1, max_tokens=6, top_logprobs=3),
            GenerationRequest(PROMPTS[1], n=2, max_tokens=6),
            GenerationRequest(PROMPTS[2], n=1, max_tokens=4, top_logprobs=20, seed=5),
        ]
    )
    assert results[0][0].top_ids.shape == (6, 3) and results[2][0].top_ids.shape == (4, 20)
    assert all(c.top_ids is None and c.top_logprobs is None for c in results[1])
    # A batch that asks for no alternatives never computes any.
    monkeypatch.setattr(hf, "_add_alternatives", lambda *_: pytest.fail("alternatives computed unasked"))
    plain = backend.generate([GenerationRequest(p, n=2, max_tokens=6) for p in PROMPTS])
    assert all(c.top_ids is None for group in plain for c in group)


def test_the_mock_engine_repeats_itself_given_a_seed(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100}))
    request = GenerationRequest(np.arange(3, dtype=np.int32), n=3, max_tokens=16, seed=11, top_logprobs=2)
    a = MockEngine(tmp_path, seed=1).generate([GenerationRequest(np.arange(3, dtype=np.int32), n=2), request])[1]
    b = MockEngine(tmp_path, seed=2).generate([request])[0]
    assert _ids(a) == _ids(b) and len({tuple(ids) for ids in _ids(a)}) == 3
    c = MockEngine(tmp_path, seed=1).generate(
        [GenerationRequest(np.arange(3, dtype=np.int32), n=1, max_tokens=16, seed=12)]
    )[0]
    assert _ids(c) == _ids(a)[1:2]
    assert a[0].top_ids.shape == (16, 2) and (a[0].top_ids[:, 0] == a[0].token_ids).all()
    np.testing.assert_allclose(a[0].top_logprobs, np.full((16, 2), -np.log(100)), rtol=1e-6)
