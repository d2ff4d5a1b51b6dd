"""Request bodies of the gateway, read and checked field by field (OpenAI's names and ranges).

`ChatRequest.parse(body)` reads `POST /v1/chat/completions`; `completions.TextRequest` reads the legacy
`POST /v1/completions` with the same helpers. Both share `Sampling`: n, temperature, top_p, max_tokens /
max_completion_tokens, stop, seed (0 to 2**63 - 1), logprobs (with chat's top_logprobs, 0 to 20, which
needs logprobs: true; the legacy route's logprobs integer is read in `completions.py`), stream and
stream_options.include_usage. A field the gateway would have to ignore in a way that changes what was
sampled (penalties, a logit bias, a response format, a forced tool choice) is refused with a 400 that
names it, unless it holds its neutral value (a client library may send the default). Fields that only
label a request (user, metadata, store, ...) are accepted and ignored; an unknown field is refused, as
the OpenAI API does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mas_async.gateway import tools as tool_fields
from mas_async.gateway.errors import bad_request
from mas_async.wire.messages import MAX_SEED

ROLES = ("system", "developer", "user", "assistant", "tool")
LABELS = frozenset({"user", "metadata", "store", "parallel_tool_calls", "service_tier"})
"""Fields that say nothing about sampling: accepted and ignored."""
OFF_POLICY = {
    "frequency_penalty": "penalties change the sampling distribution, so the sample would be off-policy",
    "presence_penalty": "penalties change the sampling distribution, so the sample would be off-policy",
    "logit_bias": "a logit bias changes the sampling distribution, so the sample would be off-policy",
}
"""Fields of both routes refused when set to anything but their neutral value (see `_neutral`)."""
CHAT_REFUSED = {
    **OFF_POLICY,
    "functions": "functions are not served (use tools)",
    "function_call": "functions are not served (use tools and tool_choice)",
    "response_format": "response_format is not served: the sample must be what the policy samples freely",
    "reasoning_effort": "reasoning_effort is not served",
    "modalities": "only text is served",
    "audio": "only text is served",
    "prediction": "predicted outputs are not served",
    "web_search_options": "web search is not served",
}
SAMPLING_FIELDS = frozenset(
    {"n", "temperature", "top_p", "max_tokens", "stop", "seed", "logprobs", "stream", "stream_options"}
)
CHAT_FIELDS = SAMPLING_FIELDS | {"model", "messages", "max_completion_tokens", "tools", "tool_choice", "top_logprobs"}
MAX_CHAT_TOP_LOGPROBS = 20
"""Chat's top_logprobs goes up to 20, as OpenAI's (and the inference servers', `wire.messages.MAX_TOP_LOGPROBS`)."""


@dataclass(slots=True, kw_only=True)
class Sampling:
    """The sampling and delivery fields both routes share. Optional ones are None when left out."""

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] | None = None
    seed: int | None = None
    """Sample choice i from a generator seeded with seed + i: the same request and seed give the same choices."""
    logprobs: bool = False
    """Return each sampled token's log-prob."""
    top_logprobs: int = 0
    """With logprobs, also the k most likely tokens at each position (0: none)."""
    stream: bool = False
    """Answer with server-sent events (`streaming.py`)."""
    include_usage: bool = False
    """stream_options.include_usage: a last chunk with the usage and no choices."""

    @classmethod
    def parse(cls, body: dict[str, Any], *, logprobs: bool, max_tokens: int | None, top_logprobs: int = 0) -> Sampling:
        stream = _bool(body, "stream")
        return cls(
            n=int_field(body, "n", 1, 1),
            temperature=_number(body, "temperature", 0.0, 2.0),
            top_p=_number(body, "top_p", 0.0, 1.0, low_open=True),
            max_tokens=max_tokens,
            stop=_stop(body.get("stop")),
            seed=int_field(body, "seed", None, 0, MAX_SEED),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            stream=stream,
            include_usage=_stream_options(body.get("stream_options"), stream),
        )


@dataclass(slots=True)
class ChatRequest:
    """A checked chat completion request."""

    model: str
    messages: list[dict[str, Any]]
    """Canonical messages: role and text content, plus name, tool_calls (`tools.tool_calls`) and tool_call_id."""
    sampling: Sampling = field(default_factory=Sampling)
    tools: list[dict[str, Any]] | None = None
    """The request's tools (function definitions), for the chat template; None when none."""
    tool_choice: str = "auto"
    """"auto" (tool calls are parsed from the reply) or "none" (the reply is plain content)."""

    @property
    def parses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice == "auto"

    @classmethod
    def parse(cls, body: Any) -> ChatRequest:
        check_fields(body, CHAT_FIELDS, CHAT_REFUSED)
        tools = tool_fields.parse_tools(body.get("tools"))
        logprobs = _bool(body, "logprobs")
        top = int_field(body, "top_logprobs", 0, 0, MAX_CHAT_TOP_LOGPROBS)
        if top and not logprobs:
            raise bad_request("top_logprobs: only allowed when logprobs is true", param="top_logprobs")
        return cls(
            model=model_of(body),
            messages=messages_of(body.get("messages")),
            sampling=Sampling.parse(body, logprobs=logprobs, max_tokens=max_tokens_of(body), top_logprobs=top),
            tools=tools,
            tool_choice=tool_fields.parse_tool_choice(body.get("tool_choice"), tools),
        )


def check_fields(body: Any, known: frozenset[str], refused: Mapping[str, str], labels: frozenset[str] = LABELS) -> None:
    """Refuse a body that is not an object, an unknown field, or a refused field set to a non-neutral value
    (`labels`: fields accepted and ignored)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for key, value in body.items():
        if key in known or key in labels:
            continue
        if key in refused:
            if not _neutral(key, value):
                raise bad_request(f"{key}: {refused[key]}", param=key, code="unsupported_parameter")
            continue
        raise bad_request(f"Unrecognized request argument supplied: {key}", param=key)


def model_of(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model: a string naming an agent of the run is required", param="model")
    return model


def _neutral(key: str, value: Any) -> bool:
    """Whether `value` of a refused field asks for nothing (a client library may send the default)."""
    if value is None or value is False:
        return True
    if key in ("frequency_penalty", "presence_penalty"):
        return value == 0
    if key in ("functions", "logit_bias", "modalities"):
        return not value or value == ["text"]
    if key in ("top_logprobs", "best_of"):
        return value == (1 if key == "best_of" else 0)
    if key in ("suffix", "echo"):
        return value == ""
    if key == "response_format":
        return isinstance(value, dict) and value.get("type") == "text"
    return False


def _stream_options(value: Any, stream: bool) -> bool:
    """stream_options.include_usage (other keys of stream_options are refused; it needs stream=true)."""
    if value is None:
        return False
    if not stream:
        raise bad_request("stream_options: only allowed when stream is true", param="stream_options")
    if not isinstance(value, dict) or set(value) - {"include_usage", "include_obfuscation"}:
        raise bad_request(
            f"stream_options: an object with include_usage is expected, got {value!r}", param="stream_options"
        )
    return _bool(value, "include_usage")


def messages_of(value: Any, field: str = "messages") -> list[dict[str, Any]]:
    """Canonical messages of a chat request's `messages` (or of the chat messages that a Responses request's
    `input` reads as, named `field` in errors)."""
    if not isinstance(value, list) or not value:
        raise bad_request(f"{field}: a non-empty list of messages is required", param=field)
    out = []
    for i, message in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where}: a message must be an object", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role: expected one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
        canonical: dict[str, Any] = {"role": role, "content": _content(message.get("content"), where, role)}
        for key in ("name", "tool_call_id"):
            if isinstance(message.get(key), str):
                canonical[key] = message[key]
        if message.get("tool_calls"):
            canonical["tool_calls"] = tool_fields.tool_calls(message["tool_calls"], f"{where}.tool_calls")
        out.append(canonical)
    return out


TEXT_PARTS_JOINER = "\n"
"""Between the text parts of one message's content, as vLLM joins them (so a prompt reads as vLLM renders it)."""


def _content(value: Any, where: str, role: str) -> str:
    """The text of a message: a string, or its text parts joined by a newline (OpenAI's two forms)."""
    if isinstance(value, str):
        return value
    if value is None and role == "assistant":
        return ""
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"{where}.content[{j}]: only text parts are served", param=f"{where}.content")
            texts.append(part["text"])
        return TEXT_PARTS_JOINER.join(texts)
    raise bad_request(f"{where}.content: a string or a list of text parts is required", param=f"{where}.content")


def int_field(body: dict[str, Any], key: str, default: int | None, low: int | None, high: int | None = None) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{key}: an integer is required, got {value!r}", param=key)
    if low is not None and value < low:
        raise bad_request(f"{key}: must be at least {low}, got {value}", param=key)
    if high is not None and value > high:
        raise bad_request(f"{key}: must be at most {high}, got {value}", param=key)
    return value


def _number(body: dict[str, Any], key: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{key}: a number is required, got {value!r}", param=key)
    if value > high or value < low or (low_open and value == low):
        bounds = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise bad_request(f"{key}: must be in {bounds}, got {value}", param=key)
    return float(value)


def _bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{key}: a boolean is required, got {value!r}", param=key)
    return value


def max_tokens_of(body: dict[str, Any]) -> int | None:
    new, old = int_field(body, "max_completion_tokens", None, 1), int_field(body, "max_tokens", None, 1)
    if new is not None and old is not None and new != old:
        raise bad_request(
            f"max_completion_tokens={new} and max_tokens={old} disagree; give one", param="max_completion_tokens"
        )
    return new if new is not None else old


def _stop(value: Any) -> list[str] | None:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise bad_request("stop: a non-empty string or a list of up to 4 of them is required", param="stop")
    return stops or None
