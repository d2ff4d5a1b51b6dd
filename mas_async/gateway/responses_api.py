"""The Responses API (`POST /v1/responses`): its request read as a chat request, and a chat answer written
back as a `response` object.

The OpenAI Agents SDK's default model and pydantic-ai's `OpenAIResponsesModel` speak this API. A request
is read into the chat request that says the same thing, so that a Responses call is sampled, recorded and
given exact tokens exactly as a chat call is (`server.Gateway.chat`, `transcript.py`):

- `instructions` -> a first system message (as vLLM does);
- `input`: a string -> one user message; a list of items ->
    - `message` items (roles user, system, developer, assistant; content a string or `input_text` /
      `output_text` parts, joined as chat's text parts are) -> messages;
    - `function_call` items -> `tool_calls` of an assistant message: of the assistant message just before
      (a reply's text and its calls are one message, so a reply sent back as its output items reads as the
      message the gateway recorded), else of a new one (`call_id` the call's id);
    - `function_call_output` items -> `role: "tool"` messages (`call_id` -> `tool_call_id`);
- `previous_response_id` -> the stored conversation of that response (its input without its instructions,
  then its output) before the new input, with this request's instructions (OpenAI's rule: instructions
  are not carried over). A response is stored in its episode's session unless `store` is false, and the
  stored responses go with the session;
- `tools` (function tools: `{"type": "function", "name", "description", "parameters", "strict"}`) -> chat's
  function tools (`strict` is accepted and not enforced: it would need constrained decoding);
  `tool_choice`, `max_output_tokens`, `temperature`, `top_p`, `top_logprobs` and
  `include: ["message.output_text.logprobs"]` -> chat's fields, under the same rules (`sampling.py`).

The answer's `output` is the chat reply's message as items: a `message` item with one `output_text` part
(unless the reply is tool calls alone), then one `function_call` item per tool call. A reply cut at
`max_output_tokens` has `status: "incomplete"` and `incomplete_details.reason: "max_output_tokens"`, as
OpenAI's and vLLM's. The response carries the top-level `mas_async` object (episode_id, agent, turn,
prompt_source) with the exact `token_ids`, `prompt_token_ids` and `weight_version` of the reply.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from mas_async.gateway import tools as tool_fields
from mas_async.gateway.errors import GatewayError, bad_request
from mas_async.gateway.requests import (
    OFF_POLICY,
    TEXT_PARTS_JOINER,
    ChatRequest,
    Sampling,
    check_fields,
    int_field,
    messages_of,
    model_of,
)

LOGPROBS = "message.output_text.logprobs"
"""The `include` value that asks for each output token's log-prob."""
RESPONSES_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "previous_response_id",
        "store",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "temperature",
        "top_p",
        "max_output_tokens",
        "include",
        "top_logprobs",
        "stream",
        "text",
        "truncation",
        "reasoning",
    }
)
RESPONSES_LABELS = frozenset(
    {"metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention"}
)
"""Fields that say nothing about sampling: accepted and ignored (as chat's `user`, `metadata`, ...)."""
RESPONSES_REFUSED = {
    **OFF_POLICY,
    "conversation": "conversations are not served: send the history in input, or use previous_response_id",
    "prompt": "stored prompt templates are not served",
    "background": "background responses are not served",
    "max_tool_calls": "max_tool_calls is not served",
    "stream_options": "streaming is not served on /v1/responses",
}
TEXT_PART_TYPES = ("input_text", "output_text", "text")
ITEM_TYPES = ("message", "function_call", "function_call_output")
MAX_TOP_LOGPROBS = 20


@dataclass(slots=True)
class ResponsesRequest:
    """A checked Responses request: what it asks, read as chat (`messages` before `previous_response_id`'s
    conversation is put in front of them), and what its response echoes."""

    model: str
    instructions: str | None
    input_messages: list[dict[str, Any]]
    """The new input as canonical chat messages (without the instructions)."""
    sampling: Sampling
    tools: list[dict[str, Any]] | None = None
    """Chat's function tools, for the chat template."""
    tool_choice: str = "auto"
    previous_response_id: str | None = None
    store: bool = True
    echo: dict[str, Any] = field(default_factory=dict)
    """Request fields that the response repeats (tools as given, tool_choice, temperature, ...)."""

    @classmethod
    def parse(cls, body: Any) -> ResponsesRequest:
        check_fields(body, RESPONSES_FIELDS, RESPONSES_REFUSED, labels=RESPONSES_LABELS)
        _neutral_or_refused(body)
        if body.get("stream"):
            raise bad_request(
                "stream: streamed responses are not served on /v1/responses; leave stream out (or use chat "
                "completions, which stream)",
                param="stream",
                code="unsupported_parameter",
            )
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise bad_request("instructions: a string is required", param="instructions")
        previous = body.get("previous_response_id")
        if previous is not None and (not isinstance(previous, str) or not previous):
            raise bad_request("previous_response_id: a response id is required", param="previous_response_id")
        value = body.get("input")
        if value is None and previous is None:
            raise bad_request("input: a string or a list of input items is required", param="input")
        store = body.get("store")
        if store is not None and not isinstance(store, bool):
            raise bad_request(f"store: a boolean is required, got {store!r}", param="store")
        tools = _tools(body.get("tools"))
        choice = body.get("tool_choice")
        return cls(
            model=model_of(body),
            instructions=instructions or None,
            input_messages=input_messages(value) if value is not None else [],
            sampling=_sampling(body),
            tools=tools,
            tool_choice=tool_fields.parse_tool_choice(choice, tools),
            previous_response_id=previous,
            store=store is not False,
            echo={
                "instructions": instructions,
                "tools": body.get("tools") or [],
                "tool_choice": choice if choice is not None else "auto",
                "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
                "temperature": body.get("temperature"),
                "top_p": body.get("top_p"),
                "max_output_tokens": body.get("max_output_tokens"),
                "top_logprobs": body.get("top_logprobs"),
                "previous_response_id": previous,
                "metadata": body.get("metadata") or {},
                "user": body.get("user"),
            },
        )

    def chat(self, history: list[dict[str, Any]]) -> ChatRequest:
        """The chat request of this one after `history` (a stored conversation; [] without one)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        messages = [*system, *history, *self.input_messages]
        if not messages:
            raise bad_request("input: the request holds no message", param="input")
        return ChatRequest(self.model, messages, self.sampling, self.tools, self.tool_choice)

    def conversation(self, history: list[dict[str, Any]], reply: dict[str, Any]) -> list[dict[str, Any]]:
        """What a later request with this response's id continues: the input after `history`, then the reply
        (the instructions are not carried over)."""
        return [*history, *self.input_messages, *messages_of([reply], "output")]


def input_messages(value: Any) -> list[dict[str, Any]]:
    """The chat messages that `input` reads as (module docstring), canonical (`requests.messages_of`)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad_request("input: a string or a list of input items is required", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: an input item must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            content = item.get("content")
            out.append({"role": item.get("role"), "content": _text(content, where, item.get("role"))})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)},
            }
            if out and out[-1]["role"] == "assistant":  # the calls of the reply whose text came just before
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where),
                    "content": _text(output, where, "tool"),
                }
            )
        else:
            raise bad_request(
                f"{where}.type: {kind!r} items are not served (only {', '.join(ITEM_TYPES)})",
                param=f"{where}.type",
                code="unsupported_parameter",
            )
    return messages_of(out, "input")


def response_object(
    request: ResponsesRequest, completion: dict[str, Any], response_id: str, store: bool
) -> dict[str, Any]:
    """The `response` of `request` from the chat completion that answered it (one choice)."""
    (choice,) = completion["choices"]
    message = choice["message"]
    incomplete = choice["finish_reason"] == "length"
    status = "incomplete" if incomplete else "completed"
    output: list[dict[str, Any]] = []
    calls = message.get("tool_calls") or []
    if message.get("content") is not None or not calls:
        part: dict[str, Any] = {"type": "output_text", "text": message.get("content") or "", "annotations": []}
        if request.sampling.logprobs:
            part["logprobs"] = (choice.get("logprobs") or {}).get("content") or []
        output.append(
            {
                "id": f"msg_{secrets.token_hex(12)}",
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": [part],
            }
        )
    for call in calls:
        output.append(
            {
                "id": f"fc_{secrets.token_hex(12)}",
                "type": "function_call",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    usage = completion["usage"]
    echo = request.echo
    return {
        "id": response_id,
        "object": "response",
        "created_at": completion["created"],
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "model": completion["model"],
        "output": output,
        **echo,
        "store": store,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "reasoning": None,
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
        "mas_async": {
            **completion["mas_async"],
            "token_ids": choice["token_ids"],
            "prompt_token_ids": choice["prompt_token_ids"],
            "weight_version": choice["weight_version"],
        },
    }


def new_id() -> str:
    return f"resp_{secrets.token_hex(16)}"


def not_found(response_id: str) -> GatewayError:
    return bad_request(
        f"Previous response with id {response_id!r} not found: a response is stored in its episode unless "
        "store is false, and only the episode's own calls can continue it",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def _sampling(body: dict[str, Any]) -> Sampling:
    include = body.get("include") or []
    top = int_field(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    chat_like = {key: body.get(key) for key in ("temperature", "top_p")}
    chat_like["max_tokens"] = int_field(body, "max_output_tokens", None, 1)
    logprobs = LOGPROBS in include or top > 0
    return Sampling.parse(chat_like, logprobs=logprobs, max_tokens=chat_like["max_tokens"], top_logprobs=top)


def _neutral_or_refused(body: dict[str, Any]) -> None:
    """Fields this route reads only at their neutral value: `include` (logprobs only), `text` (plain text),
    `truncation` ("disabled": "auto" would drop items from the history), `reasoning` (none)."""
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or any(i != LOGPROBS for i in include)):
        raise bad_request(f"include: only [{LOGPROBS!r}] is served, got {include!r}", param="include")
    text = body.get("text")
    if text is not None:
        fmt = text.get("format") if isinstance(text, dict) else None
        if not isinstance(text, dict) or (fmt is not None and fmt != {"type": "text"}) or text.get("verbosity"):
            raise bad_request(
                "text: only plain text output is served (a format or verbosity would change what the policy samples)",
                param="text",
                code="unsupported_parameter",
            )
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise bad_request(
            f"truncation={truncation!r}: only 'disabled' is served (the history is the agent's, never cut)",
            param="truncation",
            code="unsupported_parameter",
        )
    reasoning = body.get("reasoning")
    if reasoning is not None and (not isinstance(reasoning, dict) or any(v is not None for v in reasoning.values())):
        raise bad_request("reasoning is not served", param="reasoning", code="unsupported_parameter")


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """Responses function tools as chat's (`tools.parse_tools` then checks them)."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise bad_request("tools: a list of function tools is required", param="tools")
    chat_tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(
                f"tools[{i}]: only function tools are served, got type {kind!r}",
                param=f"tools[{i}]",
                code="unsupported_parameter",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        chat_tools.append({"type": "function", "function": function})
    return tool_fields.parse_tools(chat_tools)


def _text(value: Any, where: str, role: Any) -> Any:
    """A message's (or a tool output's) text: a string, or its text parts joined as chat's are; anything
    else is left for `messages_of` to refuse."""
    if not isinstance(value, list):
        return value
    texts = []
    for j, part in enumerate(value):
        if not (isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES and isinstance(part.get("text"), str)):
            raise bad_request(f"{where}.content[{j}]: only text parts are served", param=f"{where}.content")
        texts.append(part["text"])
    return TEXT_PARTS_JOINER.join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key}: a string is required", param=f"{where}.{key}")
    return value
