"""How a mini-batch is cut into micro-batches for gradient accumulation (and for log-prob recomputes).

A micro-batch holds at most `trainer.micro_batch_sequences` sequences and at most a token budget of
tokens (prompt + completion of each sequence): `trainer.max_tokens_per_micro_batch`, or where it is None
(the default) the budget derived from the model (`token_budget`), so a large iteration never needs one
huge forward. A sequence longer than the budget is a micro-batch of its own. The cut changes no update:
the loss normaliser is the mini-batch's global count (training/loss.py), so the micro-batch gradients
sum to the full batch's, up to float rounding.

The derived budget bounds the activations one micro-batch keeps for its backward by
`ACTIVATION_BYTES`. Per token and decoder layer a training forward keeps about 8 hidden-sized values
(the norms' inputs and outputs, q/k/v, the attention's output, the residual) and 4 MLP-sized ones (gate,
up, their activation and product), counted at 4 bytes whatever the dtype (under bf16 autocast the
residual stream and the norms stay float32):

    tokens = ACTIVATION_BYTES // (4 * layers * (8 * hidden + 4 * intermediate))

With `trainer.activation_checkpointing` a layer keeps only its input, and one layer at a time recomputes
the rest in the backward: 4 * (layers * hidden + 8 * hidden + 4 * intermediate) bytes per token. The
vocabulary does not enter: the log-probs compute the logits in chunks of a bounded size whatever the
micro-batch (training/logprobs.py). Qwen3-1.7B (hidden 2,048, MLP 6,144, 28 layers): 1,872 tokens, with
checkpointing 21,845; SmolLM2-135M: 6,657; the built-in tiny-char model: about a million (no cut).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ACTIVATION_BYTES = 8 * 2**30
"""What the derived token budget lets one micro-batch's activations take (`token_budget`)."""


def token_budget(model_config: Any, checkpointing: bool = False) -> int:
    """Tokens per micro-batch whose activations fit `ACTIVATION_BYTES`, for a transformers model config
    (the rule: the module docstring); an MLP size the config does not give counts as 4x the hidden size."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    hidden, layers = text.hidden_size, text.num_hidden_layers
    mlp = getattr(text, "intermediate_size", None) or 4 * hidden
    per_layer = 8 * hidden + 4 * mlp
    values = layers * hidden + per_layer if checkpointing else layers * per_layer
    return max(1, ACTIVATION_BYTES // (4 * values))


def micro_batches(lengths: Sequence[int], max_sequences: int, max_tokens: int | None = None) -> list[list[int]]:
    """Consecutive index runs over `lengths` (tokens per sequence, in order), each within both limits."""
    if max_sequences < 1:
        raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i, length in enumerate(lengths):
        full = len(current) >= max_sequences or (max_tokens is not None and tokens + length > max_tokens)
        if current and full:
            out.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += length
    if current:
        out.append(current)
    return out
