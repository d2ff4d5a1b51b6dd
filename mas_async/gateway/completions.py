"""The body of the legacy `POST /v1/completions`, and the prompt ids it asks for.

A text completion continues one prompt: a string, tokenised by the agent's policy's tokenizer with no chat
template (`encode(prompt)`, special tokens as the tokenizer adds them, as vLLM's /v1/completions does), or
a list of token ids sent as they are. A list of several prompts is refused (one request is one turn of
one agent); a one-element list is read as its element. The sampling fields and their rules are chat's
(`requests.Sampling`, `sampling.py`); `logprobs` is the legacy integer: 0 returns each sampled token's
log-prob, more (top-k alternatives) is refused like chat's top_logprobs. `echo`, `suffix` and `best_of`
above 1 are refused. The call is recorded as the agent's turn like a chat call, its prompt source "fresh".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mas_async.gateway.errors import bad_request
from mas_async.gateway.requests import (
    OFF_POLICY,
    SAMPLING_FIELDS,
    Sampling,
    check_fields,
    int_field,
    max_tokens_of,
    model_of,
)

TEXT_FIELDS = SAMPLING_FIELDS | {"model", "prompt"}
TEXT_REFUSED = {
    **OFF_POLICY,
    "echo": "echo is not served (the response holds the prompt's ids as prompt_token_ids)",
    "suffix": "suffix (insertion) is not served",
    "best_of": "best_of is not served: every choice sampled is returned and trained on (use n)",
}


@dataclass(slots=True)
class TextRequest:
    """A checked text completion request."""

    model: str
    prompt: str | list[int]
    sampling: Sampling = field(default_factory=Sampling)

    @classmethod
    def parse(cls, body: Any) -> TextRequest:
        check_fields(body, TEXT_FIELDS, TEXT_REFUSED)
        top = int_field(body, "logprobs", None, 0)
        if top is not None and top > 0:
            raise bad_request(
                f"logprobs={top}: top-k log-probs are not served (logprobs=0 gives each sampled token's log-prob)",
                param="logprobs",
                code="unsupported_parameter",
            )
        return cls(
            model=model_of(body),
            prompt=_prompt(body.get("prompt")),
            sampling=Sampling.parse(body, logprobs=top is not None, max_tokens=max_tokens_of(body)),
        )

    def prompt_ids(self, tokenizer: Any) -> np.ndarray:
        """The prompt's ids (int32[P]): the given ids, or the tokenizer's encoding of the text."""
        if isinstance(self.prompt, str):
            ids = tokenizer.encode(self.prompt)
            if not ids:
                raise bad_request("prompt: the text encodes to no tokens", param="prompt")
            return np.asarray(ids, dtype=np.int32)
        vocab = len(tokenizer)
        bad = [t for t in self.prompt if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt")
        return np.asarray(self.prompt, dtype=np.int32)


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a list of one prompt
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise bad_request(
            f"prompt: a list of {len(value)} prompts is not served: one request is one agent's turn, send one "
            "prompt per request",
            param="prompt",
        )
    raise bad_request("prompt: a non-empty string or a non-empty list of token ids is required", param="prompt")
