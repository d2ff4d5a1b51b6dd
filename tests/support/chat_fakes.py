"""Fakes for running chat-model workflows in-process: a character tokenizer and a scripted `generate`.

`ScriptedGenerate` answers each request of a policy with the next scripted list of texts and records
every call as (policy, n), so tests can check who was asked for how many candidates, in which order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mas_async.rollout.episode import Episode
from mas_async.wire.samples import Completion


class CharTokenizer:
    """Every character is a token (its code point); no special tokens. A reply that continues a given start
    (`continue_final_message`) follows it directly; otherwise the prompt ends with "<a>"."""

    def apply_chat_template(
        self, messages: list[dict], tokenize: bool, add_generation_prompt: bool = False, **options: Any
    ) -> list[int]:
        ids = [ord(ch) for m in messages for ch in f"<{m['role']}>{m['content']}"]
        return ids + [ord(ch) for ch in "<a>"] if add_generation_prompt else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)


class ScriptedGenerate:
    """policy -> list of calls, each the list of texts that call returns."""

    def __init__(self, scripts: dict[str, list[list[str]]]) -> None:
        self.scripts = {policy: list(calls) for policy, calls in scripts.items()}
        self.calls: list[tuple[str, int]] = []
        self.max_tokens: list[int | None] = []
        """Each call's max_tokens (None: the run's)."""

    async def __call__(
        self, policy: str, prompt_ids: np.ndarray, n: int, greedy: bool, max_tokens: int | None = None
    ) -> list[Completion]:
        self.calls.append((policy, n))
        self.max_tokens.append(max_tokens)
        texts = self.scripts[policy].pop(0)
        assert len(texts) == n, f"{policy}: scripted {len(texts)} texts, asked for {n}"
        return [
            Completion(np.array([ord(c) for c in t], dtype=np.int32), np.zeros(len(t), dtype=np.float32), 0)
            for t in texts
        ]


def make_episode(env: Any, agents: tuple[str, ...], generate: ScriptedGenerate, k: int, **options: Any) -> Episode:
    """A train-mode episode where each agent has its own policy, named after the agent."""
    return Episode(
        episode_id="e0",
        problem_id="p0",
        env=env,
        policy_of={agent: agent for agent in agents},
        tokenizers={agent: CharTokenizer() for agent in agents},
        generate=generate,
        k=k,
        alpha=options.pop("alpha", 1.0),
        **options,
    )
