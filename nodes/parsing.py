"""Reading chat-model answers: thinking blocks, fenced code blocks and \\boxed{} answers.

Used by the code, math and routed nodes. Qwen3 may think first (`<think>...</think>`): only the text
after the thinking counts, and an answer still inside an unfinished thinking block is no answer.
"""

from __future__ import annotations

import ast
import re

from envs.math_data import last_boxed
from mas_async.api import ParseError

FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
PYTHON_TAGS = ("python", "py", "python3", "")

__all__ = ["boxed_answer", "fenced_blocks", "python_block", "strip_thinking", "unfinished_thinking"]


def strip_thinking(text: str) -> str:
    """The text after the last `</think>`, up to a `<think>` opened again after it; "" when a `<think>` block
    never closed. Letters inside unfinished reasoning (a reply cut at max_tokens) are no answer."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1].split("<think>", 1)[0]
    if "<think>" in text:
        return ""
    return text


def unfinished_thinking(text: str) -> bool:
    """Whether the reply ends inside a `<think>` block (cut at max_tokens while reasoning)."""
    return text.rfind("<think>") > text.rfind("</think>")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language tag, body) of every closed ``` fence, in order; the tag is lowercase, may be ""."""
    return [(tag.lower(), body) for tag, body in FENCE.findall(text)]


def python_block(text: str, who: str) -> str:
    """The last fenced Python block of `text`, which must parse; ParseError (naming `who`) otherwise."""
    blocks = [body for tag, body in fenced_blocks(strip_thinking(text)) if tag in PYTHON_TAGS]
    if not blocks or not blocks[-1].strip():
        raise ParseError(f"{who}: no ```python code block in the answer")
    code = blocks[-1]
    try:
        ast.parse(code)
    except (SyntaxError, ValueError) as error:
        raise ParseError(f"{who}: the code block does not parse: {error}") from None
    return code


def boxed_answer(text: str, who: str) -> str:
    """The last non-empty \\boxed{} answer after any thinking; ParseError (naming `who`) otherwise."""
    answer = last_boxed(strip_thinking(text))
    if not answer:
        raise ParseError(f"{who}: no \\boxed{{...}} answer")
    return answer
