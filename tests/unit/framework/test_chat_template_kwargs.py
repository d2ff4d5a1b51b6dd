"""`policies.<p>.chat_template_kwargs` reach the chat template when an episode tokenises a prompt
(Qwen3's `enable_thinking: false`, as the reference trains), and only for that policy."""

from __future__ import annotations

import asyncio

import numpy as np

from mas_async.api import Node
from mas_async.config import load_config
from mas_async.rollout.episode import Episode
from mas_async.wire.samples import Completion
from tests.support.paths import ROOT


class RecordingTokenizer:
    """Renders a "thinking" marker unless the template variable enable_thinking is false."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **variables):
        self.calls.append(variables)
        text = messages[-1]["content"] + ("" if variables.get("enable_thinking") is False else "<think>")
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class Echo(Node):
    def parse(self, text):
        return text


class _Env:
    done = False

    def observe(self, agent):
        return "go"

    def clone(self):
        return self

    def step(self, agent, action):
        pass

    def team_reward(self):
        return 0.0

    def move_quality(self, agent, action, after):
        return None


def _prompt(template_kwargs) -> tuple[str, list[dict]]:
    tokenizer, seen = RecordingTokenizer(), []

    async def generate(policy, prompt_ids, n, greedy):
        seen.append("".join(chr(i) for i in prompt_ids))
        return [Completion(np.array([120], dtype=np.int32), np.zeros(1, dtype=np.float32), 0)] * n

    episode = Episode(
        episode_id="e", problem_id="p", env=_Env(), policy_of={"a": "pa", "b": "pb"},
        tokenizers={"pa": tokenizer, "pb": tokenizer}, generate=generate, k=2, alpha=1.0,
        template_kwargs=template_kwargs,
    )  # fmt: skip
    asyncio.run(episode.sample(Echo("a")))
    asyncio.run(episode.sample(Echo("b")))
    return seen, tokenizer.calls


def test_template_variables_reach_the_template_of_their_policy_only():
    prompts, calls = _prompt({"pa": {"enable_thinking": False}})
    assert prompts == ["go", "go<think>"] and calls == [{"enable_thinking": False}, {}]


def test_the_tool_plan_gpu_configs_turn_qwen3_thinking_off():
    for name in ("plan_path", "sokoban", "sudoku"):
        config = load_config(ROOT / f"configs/{name}_qwen3_1.7b.yaml")
        assert all(p.chat_template_kwargs == {"enable_thinking": False} for p in config.policies.values())
