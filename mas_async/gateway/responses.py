"""The objects the gateway answers with, in OpenAI's shapes: `chat.completion` and `text_completion`, and
the deltas of their streamed chunks (`chat.completion.chunk`, streamed `text_completion`; `streaming.py`
frames them).

Every choice carries, besides OpenAI's fields, `token_ids` (the completion's ids, exactly as sampled, cut
at a stop string), `prompt_token_ids` (the prompt's ids, exactly as the model saw them) and
`weight_version` (the version of the weights that sampled it); a response carries the top-level
`mas_async` object (episode_id, agent, turn, prompt_source). Log-probs are each sampled token's rollout
log-prob: chat's `logprobs.content` entries, or the legacy API's `tokens` / `token_logprobs` /
`top_logprobs` / `text_offset`. Alternatives come as the completion carries them (only when the request
asked for k > 0, `sampling.py`): chat's `top_logprobs` of each entry lists the k most likely tokens
(`token`, `logprob`, `bytes`), most likely first ([] without); the legacy `top_logprobs` of a position
maps each of the k tokens, and the sampled one, to its log-prob (as OpenAI's and vLLM's do; the sampled
token alone with logprobs=0). Tokens are decoded one by one, so two ids may read the same.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from mas_async.gateway.streaming import pieces
from mas_async.gateway.tools import parse_reply

if TYPE_CHECKING:
    from mas_async.wire.samples import Completion


def envelope(
    kind: str, agent: str, choices: list[dict[str, Any]], prompt_ids: np.ndarray, about: dict[str, Any]
) -> dict[str, Any]:
    """A response of `kind` ("chat.completion" or "text_completion") around its choices."""
    generated = sum(len(c["token_ids"]) for c in choices)
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return {
        "id": f"{prefix}-{secrets.token_hex(12)}",
        "object": kind,
        "created": int(time.time()),
        "model": agent,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": generated,
            "total_tokens": len(prompt_ids) + generated,
        },
        "mas_async": about,
    }


def chat_choice(
    tokenizer: Any, index: int, text: str, completion: Completion, prompt_ids: np.ndarray, logprobs: bool, tools: bool
) -> dict[str, Any]:
    """A chat choice; with `tools`, its Hermes tool calls parsed into `message.tool_calls` (`tools.py`)."""
    content, calls = parse_reply(text) if tools else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    content = None
    if logprobs:
        ids, lps = _ids(completion)
        tops = _alternatives(tokenizer, completion) or [[] for _ in ids]
        content = [
            {**_entry(token, lp), "top_logprobs": [_entry(t, v) for t, v in top]}
            for token, lp, top in zip(_tokens(tokenizer, ids), lps, tops, strict=True)
        ]
    return {
        "index": index,
        "message": message,
        "finish_reason": "tool_calls" if calls else _finish(completion),
        "logprobs": {"content": content} if logprobs else None,
        **_extras(completion, prompt_ids),
    }


def text_choice(
    tokenizer: Any, index: int, text: str, completion: Completion, prompt_ids: np.ndarray, logprobs: bool
) -> dict[str, Any]:
    """A legacy completion choice (logprobs in the legacy shape: top_logprobs maps the alternatives the
    completion carries, and the sampled token, to their log-probs)."""
    ids, lps = _ids(completion)
    legacy = None
    if logprobs:
        tokens = _tokens(tokenizer, ids)
        offsets = np.cumsum([0, *map(len, pieces(tokenizer, ids, text))])[:-1].tolist()
        tops = _alternatives(tokenizer, completion) or [[] for _ in ids]
        legacy = {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": [{**dict(top), t: lp} for t, lp, top in zip(tokens, lps, tops, strict=True)],
            "text_offset": offsets,
        }
    return {
        "index": index,
        "text": text,
        "logprobs": legacy,
        "finish_reason": _finish(completion),
        **_extras(completion, prompt_ids),
    }


def chat_deltas(tokenizer: Any) -> Callable[[dict[str, Any]], Iterator[dict[str, Any]]]:
    """The chunk choices of a chat choice: the role, then its content token by token (each with its
    log-prob when asked), or for a reply with tool calls its content and then all its calls at once."""

    def deltas(choice: dict[str, Any]) -> Iterator[dict[str, Any]]:
        message, lps = choice["message"], choice["logprobs"]
        yield _delta(choice, {"delta": {"role": "assistant", "content": ""}})
        if "tool_calls" in message:
            if message["content"]:
                yield _delta(choice, {"delta": {"content": message["content"]}})
            calls = [{"index": j, **call} for j, call in enumerate(message["tool_calls"])]
            yield _delta(choice, {"delta": {"tool_calls": calls}, "logprobs": lps})
            return
        for k, piece in _per_token(tokenizer, choice, message["content"]):
            yield _delta(
                choice, {"delta": {"content": piece}, "logprobs": lps and {"content": lps["content"][k : k + 1]}}
            )

    return deltas


def text_deltas(tokenizer: Any) -> Callable[[dict[str, Any]], Iterator[dict[str, Any]]]:
    """The chunk choices of a legacy completion choice: its text token by token (with log-probs when asked)."""

    def deltas(choice: dict[str, Any]) -> Iterator[dict[str, Any]]:
        lps = choice["logprobs"]
        for k, piece in _per_token(tokenizer, choice, choice["text"]):
            one = lps and {key: values[k : k + 1] for key, values in lps.items()}
            yield _delta(choice, {"text": piece, "logprobs": one})

    return deltas


def _per_token(tokenizer: Any, choice: dict[str, Any], text: str) -> Iterator[tuple[int, str]]:
    """(token index, text piece) to send: every token when log-probs are asked, else those that add text."""
    for k, piece in enumerate(pieces(tokenizer, choice["token_ids"], text)):
        if piece or choice["logprobs"] is not None:
            yield k, piece


def _delta(choice: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    return {"index": choice["index"], "logprobs": None, **fields, "finish_reason": None}


def _ids(completion: Completion) -> tuple[list[int], list[float]]:
    return np.asarray(completion.token_ids).tolist(), np.asarray(completion.logprobs).tolist()


def _tokens(tokenizer: Any, ids: list[int]) -> list[str]:
    return [tokenizer.decode([token], skip_special_tokens=False) for token in ids]


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def _alternatives(tokenizer: Any, completion: Completion) -> list[list[tuple[str, float]]] | None:
    """Each position's alternatives as (token, log-prob), most likely first; None when it carries none."""
    if completion.top_ids is None or completion.top_logprobs is None:
        return None
    ids, values = np.asarray(completion.top_ids).tolist(), np.asarray(completion.top_logprobs).tolist()
    return [list(zip(_tokens(tokenizer, row), lps, strict=True)) for row, lps in zip(ids, values, strict=True)]


def _finish(completion: Completion) -> str:
    return "stop" if completion.finish_reason == "stop" else "length"


def _extras(completion: Completion, prompt_ids: np.ndarray) -> dict[str, Any]:
    return {
        "token_ids": np.asarray(completion.token_ids).tolist(),
        "prompt_token_ids": np.asarray(prompt_ids).tolist(),
        "weight_version": int(completion.version),
    }
