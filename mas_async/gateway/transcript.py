"""Exact tokens across turns: one agent's exchanges in one episode, and the prompt ids of its next call.

An OpenAI client resends the whole conversation at every call. Rendering it again with the chat template
and tokenising the text would not give back the ids the model sampled (a BPE tokeniser may split the
model's own reply differently, a template may rewrite it), and the sample would then train on a prompt
the model never saw. So the transcript keeps, for every choice the gateway returned, the request's
messages and tools, the reply message, the exact ids (prompt + completion) and the prompt's rendered text.
When a new request's messages are an earlier request's messages followed by the reply the gateway gave
(its last assistant message: the same content and, for a reply with tool calls, the same calls by name and
arguments; call ids are labels and may differ), with the same tools, and the template's rendering of the
new request starts with the text of those recorded ids (the earlier prompt's rendering, then the sampled
reply as the tokenizer decodes it), its prompt is those recorded ids followed by the tokens of only what
the template wrote after them: the end of the assistant turn, the tool results and new messages, and the
generation prompt ("reused"). So a reused call renders the template once, as a fresh one does. A reply that
ended on a special token other than the template's end of turn (a tokenizer's <|endoftext|> where the
template closes turns with <|im_end|>), or that holds special tokens its text leaves out, is still the
agent's own: its sampled ids are kept (less that last token, whose end of turn the template writes).

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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from mas_async.gateway.tools import PROBE_MESSAGES, PROBE_TOOL, call_key, template_messages

SOURCES = ("fresh", "reused", "edited", "retokenized")


@dataclass(slots=True)
class Prompt:
    """The prompt of one call: the ids the model is sent, their text (the template's rendering) and source."""

    ids: np.ndarray
    text: str
    source: str


@dataclass(slots=True)
class Exchange:
    """One returned choice: the request's messages, the reply message, the prompt the model saw and the ids
    it sampled."""

    messages: list[dict[str, Any]]
    reply: dict[str, Any]
    prompt: Prompt
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
        self._special_ids: frozenset[int] | None = None

    def add(
        self,
        messages: list[dict[str, Any]],
        reply: dict[str, Any],
        prompt: Prompt,
        completion_ids: np.ndarray,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        """Remember a returned choice (`reply`: its assistant message), so that a request repeating it reuses its ids."""
        self._exchanges[_key(messages, reply, tools)] = Exchange(list(messages), reply, prompt, completion_ids)

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Prompt:
        """The prompt of a request with `messages` and `tools`: its ids (int32[P]) and source (module docstring)."""
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            return self._fresh(messages, tools, "fresh")
        exchange = self._exchanges.get(_key(messages[:last], messages[last], tools))
        if exchange is None:
            return self._fresh(messages, tools, "edited")
        text = self._render(messages, generation=True, tools=tools)
        ids = self._glue(exchange, text)
        if ids is None:
            return self._fresh(messages, tools, "retokenized", text)
        return Prompt(ids, text, "reused")

    def renders_tools(self) -> bool:
        """Whether the chat template writes a request's tools into the prompt (it may ignore them)."""
        if self._renders_tools is None:
            with_tools = self._render(PROBE_MESSAGES, generation=True, tools=[PROBE_TOOL])
            self._renders_tools = with_tools != self._render(PROBE_MESSAGES, generation=True)
        return self._renders_tools

    def _glue(self, exchange: Exchange, text: str) -> np.ndarray | None:
        """The recorded ids of `exchange` + the tokens of what `text` (the new request's rendering) holds
        after them; None when `text` does not start with the text of the recorded ids (the earlier prompt's
        rendering, then the sampled reply as one of `_readings` reads it): the template rewrites the reply."""
        before = exchange.prompt.text
        if not text.startswith(before):
            return None
        for kept, sampled in self._readings(exchange.completion_ids):
            if text.startswith(sampled, len(before)):
                rest = text[len(before) + len(sampled) :]
                tail = self.tokenizer.encode(rest, add_special_tokens=False) if rest else []
                parts = [exchange.prompt.ids, kept, np.asarray(tail, dtype=np.int32)]
                return np.concatenate(parts).astype(np.int32)
        return None

    def _readings(self, ids: np.ndarray) -> Iterator[tuple[np.ndarray, str]]:
        """The ways a template may write a sampled reply back, each as (the sampled ids kept, their text):
        every id as decoded (a reply that ends on the template's own end of turn, <|im_end|> for ChatML);
        then, for a reply that ends on another special token (the tokenizer's <|endoftext|>), the ids before
        it, whose end of turn the template writes; then those ids with the special tokens that the reply's
        text leaves out (the content a program gets is decoded without them), kept in the ids, where the
        model sampled them, though the template cannot write them back."""
        yield ids, self.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
        if self._special_ids is None:
            self._special_ids = frozenset(int(i) for i in self.tokenizer.all_special_ids)
        kept = ids[:-1] if len(ids) and int(ids[-1]) in self._special_ids else ids
        if len(kept) < len(ids):
            yield kept, self.tokenizer.decode(kept.tolist(), skip_special_tokens=False)
        if any(int(i) in self._special_ids for i in kept):
            yield kept, self.tokenizer.decode(kept.tolist(), skip_special_tokens=True)

    def _kwargs(self, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        return {**self.template_kwargs, "tools": tools} if tools else self.template_kwargs

    def _render(
        self, messages: list[dict[str, Any]], generation: bool, tools: list[dict[str, Any]] | None = None
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            template_messages(messages), add_generation_prompt=generation, tokenize=False, **self._kwargs(tools)
        )
        return text if isinstance(text, str) else str(text)

    def _fresh(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, source: str, text: str | None = None
    ) -> Prompt:
        """The whole conversation rendered (unless `text` is its rendering already) and tokenised, as
        `apply_chat_template(..., tokenize=True)` tokenises it."""
        if text is None:
            text = self._render(messages, generation=True, tools=tools)
        ids = np.asarray(self.tokenizer.encode(text, add_special_tokens=False), dtype=np.int32)
        if ids.size == 0:
            raise ValueError("the chat template rendered these messages as no tokens")
        return Prompt(ids, text, source)
