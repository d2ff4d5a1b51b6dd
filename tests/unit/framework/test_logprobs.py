"""The trainer's log-probs: a right-padded batch without an attention mask gives every sequence exactly
what a masked batch and the sequence alone give, log-probs and gradients; completions sharing a prompt's
pass attend through an additive mask."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.trainer_logprobs import masked_logprobs  # the reference: the batch with its attention mask
from mas_async.training.logprobs import completion_logprobs


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    with torch.no_grad():  # sharper than the init, so that a pad leaking into attention would show
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(20.0)
    return model


def _batch() -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(3)
    lengths = [(4, 9), (31, 2), (12, 17), (1, 5)]  # (prompt, completion): widths differ by up to 30 pads
    prompts = [rng.integers(7, 51, size=p).astype(np.int32) for p, _ in lengths]
    completions = [rng.integers(7, 51, size=c).astype(np.int32) for _, c in lengths]
    return prompts, completions


def _grads(model) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def test_unmasked_right_padded_batch_equals_masked_batch_and_each_sequence_alone(model) -> None:
    prompts, completions = _batch()
    with torch.no_grad():
        ours = completion_logprobs(model, prompts, completions)
        masked = masked_logprobs(model, prompts, completions)
        alone = [completion_logprobs(model, [p], [c])[0] for p, c in zip(prompts, completions, strict=True)]
    assert [len(t) for t in ours] == [len(c) for c in completions]
    assert float(torch.cat(ours).std()) > 0.5  # sharp, varied log-probs: a leak would move them
    for a, b, c in zip(ours, masked, alone, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-6)  # other shapes: float rounding only


def _tree_batch() -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Three prompts of different lengths with 3, 1 and 2 completions (one of them empty), interleaved."""
    rng = np.random.default_rng(5)
    shared = [rng.integers(7, 51, size=n).astype(np.int32) for n in (23, 6, 14)]
    owners = [0, 1, 0, 2, 0, 2]
    lengths = [7, 12, 1, 0, 19, 4]
    return [shared[u] for u in owners], [rng.integers(7, 51, size=n).astype(np.int32) for n in lengths]


def test_completions_of_one_prompt_share_its_pass_and_equal_the_masked_batch(model, monkeypatch) -> None:
    from mas_async.training import logprobs

    prompts, completions = _tree_batch()
    with torch.no_grad():
        masked = masked_logprobs(model, prompts, completions)
        alone = [completion_logprobs(model, [p], [c])[0] for p, c in zip(prompts, completions, strict=True)]
        flat = completion_logprobs(model, prompts, completions, share_prompts=False)
    monkeypatch.setattr(logprobs, "_batch_hidden", None)  # the shared path must be the one that runs
    calls = []
    monkeypatch.setattr(
        model, "forward", lambda *a, _f=model.forward, **kw: calls.append(kw["input_ids"].shape) or _f(*a, **kw)
    )
    entropies: list[torch.Tensor] = []
    with torch.no_grad():
        ours = completion_logprobs(model, prompts, completions, entropies=entropies)
    assert calls == [(3, 23), (6, 19)]  # each distinct prompt once, then every completion
    assert [len(t) for t in ours] == [len(c) for c in completions] == [len(e) for e in entropies]
    for a, b, c in zip(ours, masked, alone, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-6)
    for a, b in zip(ours, flat, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-6)


def _prefix_batch() -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Three distinct prompts that start with the same 20 tokens (a node's system message and examples),
    one of them with two completions; and one prompt that is that first part and one token more."""
    rng = np.random.default_rng(7)
    head = rng.integers(7, 51, size=20).astype(np.int32)
    tails = [rng.integers(7, 51, size=n).astype(np.int32) for n in (5, 11, 3, 1)]
    owners = [0, 1, 2, 1, 3]
    lengths = [6, 3, 9, 1, 4]
    prompts = [np.concatenate([head, tails[u]]) for u in owners]
    return prompts, [rng.integers(7, 51, size=n).astype(np.int32) for n in lengths]


def test_prompts_with_a_common_first_part_share_one_pass_over_it(model, monkeypatch) -> None:
    from mas_async.training import logprobs

    prompts, completions = _prefix_batch()
    with torch.no_grad():
        masked = masked_logprobs(model, prompts, completions)
    monkeypatch.setattr(logprobs, "_batch_hidden", None)
    calls = []
    monkeypatch.setattr(
        model, "forward", lambda *a, _f=model.forward, **kw: calls.append(kw["input_ids"].shape) or _f(*a, **kw)
    )
    with torch.no_grad():
        ours = completion_logprobs(model, prompts, completions)
        distinct = completion_logprobs(model, prompts[:3], completions[:3])  # no prompt repeats: still shared
    # the 20 common tokens once, the rest of each of the 4 prompts, then every completion
    assert calls == [(1, 20), (4, 11), (5, 9), (1, 20), (3, 11), (3, 9)]
    for a, b in zip(ours, masked, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-6)
    for a, b in zip(distinct, masked[:3], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-6)


def test_common_prefix_length_leaves_every_prompt_its_last_token() -> None:
    from mas_async.prefixes import common_prefix_length

    a = np.arange(10, dtype=np.int32)
    assert common_prefix_length([a, a.copy()]) == 9
    assert common_prefix_length([a, np.concatenate([a[:4], [99], a[5:]]).astype(np.int32)]) == 4
    assert common_prefix_length([a, a[:3]]) == 2
    assert common_prefix_length([a[:1], a]) == 0


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16 autocast"])
def test_the_completions_mask_is_additive_in_the_attentions_dtype(model, monkeypatch, autocast) -> None:
    """Given as booleans, the mask would be converted again in every layer: it comes as 0 / -inf, in
    the dtype of the queries, and hides exactly the cache's padding and later completion tokens."""
    prompts, completions = _tree_batch()
    masks = []
    monkeypatch.setattr(
        model, "forward", lambda *a, _f=model.forward, **kw: masks.append(kw.get("attention_mask")) or _f(*a, **kw)
    )
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        completion_logprobs(model, prompts, completions)
    mask = masks[1]  # [N, 1, completion steps, prompt width + completion steps]
    assert mask.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert set(mask.unique().tolist()) == {0.0, float("-inf")}
    starts, p_width, c_width = [23, 6, 23, 14, 23, 14], 23, 19
    keys, steps = torch.arange(p_width + c_width)[None, None, :], torch.arange(c_width)[None, :, None]
    allowed = (keys < torch.tensor(starts)[:, None, None]) | ((keys >= p_width) & (keys - p_width <= steps))
    assert torch.equal(mask[:, 0] == 0, allowed)


@pytest.mark.parametrize(
    "make", [_batch, _tree_batch, _prefix_batch], ids=["distinct prompts", "shared prompts", "common first part"]
)
def test_gradient_equals_the_masked_batchs(model, make) -> None:
    prompts, completions = make()
    weights = [torch.linspace(-1.0, 1.0, len(c)) for c in completions]
    loss = sum((lp * w).sum() for lp, w in zip(completion_logprobs(model, prompts, completions), weights, strict=True))
    loss.backward()
    ours = _grads(model)
    loss = sum((lp * w).sum() for lp, w in zip(masked_logprobs(model, prompts, completions), weights, strict=True))
    loss.backward()
    for a, b in zip(ours, _grads(model), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_activation_checkpointing_takes_the_whole_sequence_batch(model, monkeypatch) -> None:
    from mas_async.training import logprobs

    prompts, completions = _tree_batch()
    checkpointed = copy.deepcopy(model)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed.train()
    monkeypatch.setattr(logprobs, "_shared_prompt_hidden", None)  # transformers drops the cache here
    ours = completion_logprobs(checkpointed, prompts, completions)
    with torch.no_grad():
        for a, b in zip(ours, masked_logprobs(model, prompts, completions), strict=True):
            torch.testing.assert_close(a.detach(), b, atol=1e-5, rtol=1e-6)
