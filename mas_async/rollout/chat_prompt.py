"""A node's chat messages as the token ids a policy reads: the one place prompts are tokenised.

The env worker tokenises every prompt here with the policy's own chat template (token ids are the truth
from then on; nothing re-tokenises), and `mas-async prompts` prints the same text. A node's messages
usually end with the user's turn: the template's generation prompt opens the assistant's reply. They may
instead end with a partial assistant message (e.g. "Answer:"): the reply then continues that message
(`continue_final_message`), so a small model is held to a format without a worked example; the node's
`parse` reads the completion that follows it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def continues_reply(messages: list[dict[str, Any]]) -> bool:
    """Whether `messages` end with a partial assistant message that the reply continues."""
    return bool(messages) and messages[-1].get("role") == "assistant"


def _template_options(messages: list[dict[str, Any]], template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    # `continue_final_message` only where it applies: a tokenizer that predates it still renders the rest.
    options = {"continue_final_message": True} if continues_reply(messages) else {"add_generation_prompt": True}
    return {**options, **(template_kwargs or {})}


def chat_prompt_ids(
    tokenizer: Any, messages: list[dict[str, Any]], template_kwargs: Mapping[str, Any] | None = None
) -> np.ndarray:
    """Token ids (int32[P]) of `messages` under the tokenizer's chat template, ready for the reply.
    transformers 5 may return a BatchEncoding (a mapping) instead of a list of ids."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, **_template_options(messages, template_kwargs))
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    array = np.asarray(ids, dtype=np.int32)
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"chat template gave token ids of shape {array.shape}, expected a non-empty 1-D sequence")
    return array


def chat_prompt_text(
    tokenizer: Any, messages: list[dict[str, Any]], template_kwargs: Mapping[str, Any] | None = None
) -> str:
    """The text of `messages` under the tokenizer's chat template, as `chat_prompt_ids` tokenises it."""
    return tokenizer.apply_chat_template(messages, tokenize=False, **_template_options(messages, template_kwargs))
