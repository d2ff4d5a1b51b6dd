"""Exact tokens across turns: one agent's exchanges in one episode, and the prompt ids of its next call.

An OpenAI client resends the whole conversation at every call. Rendering it again with the chat template
and tokenising the text would not give back the ids the model sampled (a BPE tokeniser may split the
model's own reply differently, a template may rewrite it), and the sample would then train on a prompt
the model never saw. So the transcript keeps, for every choice the gateway returned, the request's
messages and tools, the reply message and the exact ids (prompt + completion). When a new request's
messages are an earlier request's messages followed by the reply the gateway gave (its last assistant
message: the same content and, for a reply with tool calls, the same calls by name and arguments; call ids
are labels and may differ), with the same tools, its prompt is those recorded ids followed by the
template's rendering of only what came after: the end of the assistant turn, the tool results and new
messages, and the generation prompt ("reused").

Otherwise the prompt is the whole conversation rendered and tokenised afresh: "fresh" when it holds no
assistant message (a new conversation), "edited" when it holds one that this agent did not produce in
this episode with exactly these earlier messages (the history was edited: counted as a prefix mismatch),
and "retokenized" when the history is this agent's own but the template renders the reply differently
from the sampled text (a template that drops a reasoning block from the history, a reply cut by a stop
string), so no recorded ids can be glued to its rendering. In every case the prompt ids are what the
model is sent, and the sample is built from them: the trainer always sees what the model saw.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from mas_async.gateway.tools import PROBE_MESSAGES, PROBE_TOOL, call_key, template_messages
from mas_async.rollout.episode import _prompt_ids

SOURCES = ("fresh", "reused", "edited", "retokenized")


@dataclass(slots=True)
class Exchange:
    """One returned choice: the request's messages, the reply message, and the ids the model saw and sampled."""

    messages: list[dict[str, Any]]
    reply: dict[str, Any]
    prompt_ids: np.ndarray
    completion_ids: np.ndarray


def _key(messages: list[dict[str, Any]], reply: dict[str, Any], tools: list[dict[str, Any]] | None) -> str:
    """An exchange's identity: the messages, the reply's content and tool calls (`tools.call_key`), the tools."""
    said = {"content": reply.get("content") or "", "tool_calls": call_key(reply.get("tool_calls"))}
    return json.dumps([messages, said, tools or []], sort_keys=True, ensure_ascii=False)


class Transcript:
    """One (episode, agent)'s exchanges; `prompt(messages)` gives the ids of the next call and their source."""

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self._exchanges: dict[str, Exchange] = {}
        self._renders_tools: bool | None = None

    def add(
        self,
        messages: list[dict[str, Any]],
        reply: dict[str, Any],
        prompt_ids: np.ndarray,
        completion_ids: np.ndarray,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        """Remember a returned choice (`reply`: its assistant message), so that a request repeating it reuses its ids."""
        self._exchanges[_key(messages, reply, tools)] = Exchange(list(messages), reply, prompt_ids, completion_ids)

    def prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> tuple[np.ndarray, str]:
        """The prompt ids (int32[P]) of a request with `messages` and `tools`, and their source (module docstring)."""
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            return self._fresh(messages, tools), "fresh"
        exchange = self._exchanges.get(_key(messages[:last], messages[last], tools))
        if exchange is None:
            return self._fresh(messages, tools), "edited"
        ids = self._glue(exchange, messages, last, tools)
        if ids is None:
            return self._fresh(messages, tools), "retokenized"
        return ids, "reused"

    def renders_tools(self) -> bool:
        """Whether the chat template writes a request's tools into the prompt (it may ignore them)."""
        if self._renders_tools is None:
            with_tools = self._render(PROBE_MESSAGES, generation=True, tools=[PROBE_TOOL])
            self._renders_tools = with_tools != self._render(PROBE_MESSAGES, generation=True)
        return self._renders_tools

    def _glue(
        self, exchange: Exchange, messages: list[dict[str, Any]], last: int, tools: list[dict[str, Any]] | None
    ) -> np.ndarray | None:
        """The recorded ids of `exchange` + the tokens of what the template renders after its reply."""
        before = self._render(exchange.messages, generation=True, tools=tools)
        with_reply = self._render(messages[: last + 1], generation=False, tools=tools)
        after = self._render(messages, generation=True, tools=tools)
        if not (with_reply.startswith(before) and after.startswith(with_reply)):
            return None
        body = with_reply[len(before) :]  # the assistant turn as the template writes it
        sampled = self.tokenizer.decode(exchange.completion_ids.tolist(), skip_special_tokens=False)
        if not body.startswith(sampled):
            return None
        rest = body[len(sampled) :] + after[len(with_reply) :]
        tail = self.tokenizer.encode(rest, add_special_tokens=False) if rest else []
        parts = [exchange.prompt_ids, exchange.completion_ids, np.asarray(tail, dtype=np.int32)]
        return np.concatenate(parts).astype(np.int32)

    def _kwargs(self, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        return {**self.template_kwargs, "tools": tools} if tools else self.template_kwargs

    def _render(
        self, messages: list[dict[str, Any]], generation: bool, tools: list[dict[str, Any]] | None = None
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            template_messages(messages), add_generation_prompt=generation, tokenize=False, **self._kwargs(tools)
        )
        return text if isinstance(text, str) else str(text)

    def _fresh(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> np.ndarray:
        return _prompt_ids(self.tokenizer, template_messages(messages), self._kwargs(tools))
