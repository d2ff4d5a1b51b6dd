"""Tools: the `tools` and `tool_choice` of a chat request, tool calls in a history, and tool calls parsed
from a reply in the Hermes/Qwen format.

A request's tools go to the policy's chat template (`apply_chat_template(tools=...)`, as vLLM passes
them); a template that ignores them cannot tell the model about them, so the gateway refuses tools for it
(`renders_tools`). `tool_choice` may be "auto" (the default with tools: the reply is parsed) or "none"
(the tools are still rendered, the reply is plain content, as vLLM does); "required" and a named function
are refused, because only constrained decoding could honour them and a constrained sample is not what
the policy samples.

A reply's tool calls are read as vLLM's `hermes` parser reads them: every `<tool_call>...</tool_call>`
block (or an unterminated last one) holds JSON `{"name": ..., "arguments": {...}}`; the calls become
`message.tool_calls` (`arguments` a JSON string), the text outside the blocks, stripped, is the content
(None when empty), and the finish reason is "tool_calls". If any block is not such JSON, the reply has no
tool calls and its whole text is the content (vLLM's rule).

History messages keep OpenAI's shape (`arguments` a JSON string); `template_messages` hands the chat
template the arguments as objects, as HF templates expect (`tool_call.arguments | tojson`) and vLLM does.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from mas_async.gateway.errors import bad_request

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
PROBE_TOOL = {
    "type": "function",
    "function": {"name": "mas_async_probe", "description": "probe", "parameters": {"type": "object"}},
}
"""A tool rendered once per transcript to learn whether the template writes tools into the prompt."""
PROBE_MESSAGES = [{"role": "user", "content": "?"}]


def parse_tools(value: Any) -> list[dict[str, Any]] | None:
    """The request's `tools`: a list of {"type": "function", "function": {"name", "description"?, "parameters"?}}."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise bad_request("tools: a list of function tools is required", param="tools")
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise bad_request(f'{where}: {{"type": "function", "function": {{...}}}} is required', param=where)
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f"{where}.function.name: a non-empty string is required", param=f"{where}.function")
        if not isinstance(function.get("parameters", {}), dict):
            raise bad_request(f"{where}.function.parameters: a JSON schema object is required", param=where)
    return value


def parse_tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> str:
    """ "auto" or "none"; "required" and a named function are refused (module docstring)."""
    if value is None or value == "auto":
        return "auto"
    if value == "none":
        return "none"
    if value == "required" or isinstance(value, dict):
        raise bad_request(
            f"tool_choice={json.dumps(value)}: only 'auto' and 'none' are served. Forcing a tool call needs "
            "constrained decoding, and a constrained sample is not what the policy samples",
            param="tool_choice",
            code="unsupported_parameter",
        )
    raise bad_request(f"tool_choice: 'auto' or 'none' expected, got {value!r}", param="tool_choice")


def tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls in OpenAI's shape: [{"id", "type": "function", "function": {"name", "arguments"}}]."""
    if not isinstance(value, list):
        raise bad_request(f"{where}: a list of tool calls is required", param=where)
    out = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not (
            isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), str)
        ):
            raise bad_request(
                f'{where}[{j}]: {{"type": "function", "function": {{"name": str, "arguments": str}}}} is required',
                param=where,
            )
        out.append(
            {
                "id": str(call.get("id", "")),
                "type": "function",
                "function": {"name": function["name"], "arguments": function["arguments"]},
            }
        )
    return out


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` for a chat template: tool call arguments that are JSON objects given as objects."""
    if not any(m.get("tool_calls") for m in messages):
        return messages
    return [
        {**m, "tool_calls": [_as_objects(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages
    ]


def call_key(calls: list[dict[str, Any]] | None) -> list[list[str]]:
    """What identifies tool calls for exact-token reuse: name and arguments (as canonical JSON); ids are
    labels the template does not render, so a program may send them back changed."""
    key = []
    for call in calls or []:
        function = call.get("function") if isinstance(call, dict) else None
        function = function if isinstance(function, dict) else {}
        arguments = function.get("arguments")
        try:
            arguments = json.dumps(json.loads(arguments), sort_keys=True, ensure_ascii=False)
        except (TypeError, ValueError):
            arguments = str(arguments)
        key.append([str(function.get("name")), arguments])
    return key


def parse_reply(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a reply in the Hermes format (module docstring); no calls: (text, [])."""
    if "<tool_call>" not in text:
        return text, []
    calls = []
    for match in TOOL_CALL.finditer(text):
        raw = match.group(1) if match.group(1) is not None else match.group(2)
        try:
            call = json.loads(raw.strip())
        except ValueError:
            return text, []
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return text, []
        arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
        calls.append(
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {"name": call["name"], "arguments": arguments},
            }
        )
    content = TOOL_CALL.sub("", text).strip()
    return content or None, calls


def _as_objects(call: Any) -> Any:
    """A tool call whose `function.arguments` is a JSON object's text, with the object instead."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}} if isinstance(arguments, dict) else call
