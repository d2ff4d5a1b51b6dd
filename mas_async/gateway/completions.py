"""The body of the legacy `POST /v1/completions`, and the prompt ids it asks for.

A text completion continues one prompt: a string, tokenised by the agent's policy's tokenizer with no chat
template (`encode(prompt)`, special tokens as the tokenizer adds them, as vLLM's /v1/completions does), or
a list of token ids sent as they are. A list of several prompts is refused (one request is one turn of
one agent); a one-element list is read as its element. The sampling fields and their rules are chat's
(`requests.Sampling`, `sampling.py`); `logprobs` is the legacy integer k, 0 to 5 as OpenAI's: each
sampled token's log-prob, and with k > 0 its k most likely alternatives (`top_logprobs`, which then also
holds the sampled token, as OpenAI's and vLLM's do). `echo`, `suffix` and `best_of` above 1 are refused,
and chat's `top_logprobs` field is not this route's. The call is recorded as the agent's turn like a chat
call, its prompt source "fresh".
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
MAX_TEXT_LOGPROBS = 5
"""The legacy API's logprobs goes up to 5."""
TEXT_REFUSED = {
    **OFF_POLICY,
    "top_logprobs": "top_logprobs is a chat field; here logprobs=k (0 to 5) returns k alternatives",
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
        top = int_field(body, "logprobs", None, 0, MAX_TEXT_LOGPROBS)
        return cls(
            model=model_of(body),
            prompt=_prompt(body.get("prompt")),
            sampling=Sampling.parse(
                body, logprobs=top is not None, max_tokens=max_tokens_of(body), top_logprobs=top or 0
            ),
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
