"""The log-probs in bounded memory: computed in chunks of completion positions from the model's hidden
states, they equal one pass over each whole sequence's logits (values, entropies and gradients, on both
paths, at any temperature), through a DDP-style wrapper too; and a training forward, the learner's step
included, saves no float32 logits of more than one chunk for its backward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mas_async.training import logprobs
from mas_async.training.logprobs import completion_logprobs
from tests.unit.framework.test_logprobs import _batch, _prefix_batch, _tree_batch

BATCHES = {"distinct prompts": _batch, "shared prompts": _tree_batch, "common first part": _prefix_batch}
VOCAB = 8192
"""The big-vocabulary model's: its [T, V] logits outweigh every activation, as Qwen3's do."""


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    with torch.no_grad():  # sharper than the init: log-probs and entropies far from uniform
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(20.0)
    return model


def _big_vocab_model() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=64, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).float()


def _reference(model, prompts, completions, temperature) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each sequence alone, its whole [T, V] logits at once: log-probs and entropies."""
    out, entropies = [], []
    for p, c in zip(prompts, completions, strict=True):
        ids = torch.from_numpy(np.concatenate([p, c]).astype(np.int64))[None]
        logits = model(input_ids=ids, use_cache=False).logits[0, len(p) - 1 : len(p) - 1 + len(c)]
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        out.append(logp.gather(-1, ids[0, len(p) :, None]).squeeze(-1))
        entropies.append(-(logp.exp() * logp).sum(-1))
    return out, entropies


def _loss_and_grads(model, logps, entropies) -> list[torch.Tensor]:
    """The gradients of a loss of both the log-probs and the entropies, position-weighted."""
    loss = sum(
        (lp * torch.linspace(-1.0, 1.0, len(lp))).sum() + (e * torch.linspace(0.5, -0.5, len(e))).sum()
        for lp, e in zip(logps, entropies, strict=True)
    )
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("make", BATCHES.values(), ids=BATCHES.keys())
def test_chunked_logprobs_equal_one_pass_values_entropies_and_gradients(model, make, temperature) -> None:
    prompts, completions = make()
    head_calls = []
    # Positions per LM head call (the model's own call asks for none).
    rows = lambda _m, _a, out: out.numel() and head_calls.append(out.numel() // out.shape[-1])  # noqa: E731
    handle = model.get_output_embeddings().register_forward_hook(rows)
    results = {}
    try:
        for chunk in (3, None):  # 3 positions at a time, checkpointed; all at once (the tiny vocabulary's)
            head_calls.clear()
            entropies: list[torch.Tensor] = []
            ours = completion_logprobs(model, prompts, completions, temperature, entropies, chunk=chunk)
            forward_calls = len(head_calls)
            results[chunk] = (ours, entropies, _loss_and_grads(model, ours, entropies))
            if chunk == 3:  # every chunk's logits once in the forward and once more in its backward
                assert forward_calls == -(-sum(map(len, completions)) // 3) and len(head_calls) == 2 * forward_calls
                assert max(head_calls) == 3
            else:
                assert forward_calls == len(head_calls) == 1
    finally:
        handle.remove()
    ref, ref_entropies = _reference(model, prompts, completions, temperature)
    ref_grads = _loss_and_grads(model, ref, ref_entropies)
    chunked, whole = results[3], results[None]
    assert [len(t) for t in chunked[0]] == [len(c) for c in completions] == [len(e) for e in chunked[1]]
    assert float(torch.cat(ref).detach().std()) > 0.5  # far from uniform: a wrong row would show
    assert float(torch.cat(ref_entropies).detach().std()) > 0.05
    # The same maths on row blocks of other sizes: the LM head's matrix products round differently, by
    # a few ulp of the sharp logits (magnitudes near 100).
    for got, want, ref_value in zip(chunked[0] + chunked[1], whole[0] + whole[1], ref + ref_entropies, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(got.detach(), ref_value.detach(), atol=1e-5, rtol=1e-6)
    scale = max(float(g.abs().max()) for g in whole[2])  # sums of many terms: rounding relative to the largest
    for got, want, ref_grad in zip(chunked[2], whole[2], ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6 * scale, rtol=1e-5)
        torch.testing.assert_close(got, ref_grad, atol=1e-6 * scale, rtol=1e-5)


class _Wrapper(torch.nn.Module):
    """What DistributedDataParallel looks like to the log-probs: the model as `.module`, its forwards counted."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.forwards = 0

    def forward(self, **inputs):
        self.forwards += 1
        return self.module(**inputs)


@pytest.mark.parametrize("make", BATCHES.values(), ids=BATCHES.keys())
def test_through_a_ddp_style_wrapper_one_wrapped_forward_gives_the_same_logprobs(model, make) -> None:
    """Under DDP each backward must follow a forward through the wrapper: the whole-sequence batch, or the
    completions' pass of the shared path, goes through it, and the hidden states are the model's."""
    prompts, completions = make()
    wrapped = _Wrapper(model)
    ours = completion_logprobs(wrapped, prompts, completions, chunk=4)
    assert wrapped.forwards == 1
    grads = _loss_and_grads(model, ours, [torch.zeros(len(c)) for c in completions])
    plain = completion_logprobs(model, prompts, completions, chunk=4)
    for got, want in zip(ours, plain, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    for got, want in zip(grads, _loss_and_grads(model, plain, [torch.zeros(len(c)) for c in completions]), strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def _largest_saved(model: torch.nn.Module, run) -> tuple[int, object]:
    """Bytes of the largest tensor other than a parameter that autograd saves for backward while `run()`
    runs (tensors a checkpoint recomputes are not saved), and what `run` returned."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in parameters:
            sizes.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    return max(sizes), result


def _long_batch(shared: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Three 12-token prompts (one prompt thrice when `shared`) with completions of 97, 160 and 40 tokens."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(7, VOCAB, size=12).astype(np.int32) for _ in range(3)]
    if shared:
        prompts = [prompts[0]] * 3
    return prompts, [rng.integers(7, VOCAB, size=n).astype(np.int32) for n in (97, 160, 40)]


@pytest.mark.parametrize("shared", [False, True], ids=["one batch", "shared prompt"])
def test_a_training_forward_saves_no_float32_logits_beyond_one_chunk(monkeypatch, shared) -> None:
    """The memory defect: a float32 log-softmax of [T, V] kept per sample (at Qwen3's vocabulary 2.5 GB
    for 4,096 tokens). With chunks of 16 positions nothing saved for backward reaches 16 x V x 4 bytes,
    entropies with gradients included, and the gradients still arrive."""
    model = _big_vocab_model()
    chunk_bytes = 16 * VOCAB * 4
    monkeypatch.setattr(logprobs, "LOGITS_CHUNK_BYTES", chunk_bytes, raising=False)
    prompts, completions = _long_batch(shared)
    entropies: list[torch.Tensor] = []
    largest, ours = _largest_saved(model, lambda: completion_logprobs(model, prompts, completions, 1.0, entropies))
    assert largest < chunk_bytes, f"{largest} bytes saved for backward (a sample's logits: {160 * VOCAB * 4})"
    sum(t.sum() for t in ours + entropies).backward()
    assert float(model.get_output_embeddings().weight.grad.abs().sum()) > 0


def test_the_learners_training_step_saves_no_float32_logits_beyond_one_chunk(monkeypatch, tmp_path) -> None:
    """The whole step (micro-batches, log-probs, loss, backward): bounded by one chunk of logits, and the
    recomputed log-probs still match the rollout's (the chunked head is the same maths)."""
    from mas_async.config import load_config
    from mas_async.training.learner import PolicyLearner
    from mas_async.wire.samples import Sample
    from tests.support.paths import ROOT

    model = _big_vocab_model()
    model.save_pretrained(str(tmp_path))
    chunk_bytes = 16 * VOCAB * 4
    monkeypatch.setattr(logprobs, "LOGITS_CHUNK_BYTES", chunk_bytes, raising=False)
    prompts, completions = _long_batch(shared=True)
    with torch.no_grad():
        rollout = completion_logprobs(model, prompts, completions, share_prompts=False)
    samples = [
        Sample("e0/vertical/0", "e0", "p", "vertical", "vertical", 0, p, c, lp.numpy(), 0, float(i))
        for i, (p, c, lp) in enumerate(zip(prompts, completions, rollout, strict=True))
    ]
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["algorithm.entropy_coef=0.01"])
    learner = PolicyLearner(config, "vertical", str(tmp_path))
    largest, metrics = _largest_saved(learner.model, lambda: learner.step(samples, 0))
    assert largest < chunk_bytes, f"{largest} bytes saved for backward (a sample's logits: {160 * VOCAB * 4})"
    assert metrics["micro_batches"] >= 1 and metrics["logprob_abs_diff"] < 1e-6 and metrics["grad_norm"] > 0


def test_a_lone_pair_takes_the_batch_path(model, monkeypatch) -> None:
    """One prompt and one completion share nothing: the fused causal attention of the batch, no mask of
    [T, P + T] (a long prompt is its own common first part, which must not count)."""
    prompts, completions = _batch()
    monkeypatch.setattr(logprobs, "_shared_prompt_hidden", None)
    with torch.no_grad():
        assert len(completion_logprobs(model, prompts[1:2], completions[1:2])[0]) == len(completions[1])
