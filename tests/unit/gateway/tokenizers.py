"""Tokenizers for the gateway's tests, built offline: the tiny character model's, and one with a merge."""

from __future__ import annotations

from typing import Any


def merging_tokenizer(chat_template: str | None = None) -> Any:
    """The tiny-char tokenizer plus one BPE merge, "U" + "D" -> "UD": the text "UD" tokenises to one id,
    while a model may sample "U" then "D", so re-tokenising its reply would change its ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from mas_async import tiny_model as tm

    vocab = {tok: i for i, tok in enumerate([*tm.VOCAB, "UD"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("U", "D")], unk_token=tm.UNK_TOKEN))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tm.SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in tm.ROLE_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=tm.EOS_TOKEN,
        pad_token=tm.EOS_TOKEN,
        unk_token=tm.UNK_TOKEN,
        additional_special_tokens=[tm.IM_START, tm.IM_END],
        chat_template=chat_template or tm.CHAT_TEMPLATE,
    )


TOOLS_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\nTools:' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant' }}{%- if message['content'] %}{{ '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson }}{{ '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""A Qwen2.5-style chat template with tools: the tools in a system turn, an assistant's tool calls as
Hermes `<tool_call>` blocks (arguments as JSON objects), tool results as `<tool_response>` user turns."""


PLAIN_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML that ignores `tools` (as many models' templates do: SmolLM2's)."""


def plain_tokenizer() -> Any:
    """The tiny-char tokenizer with a template that renders no tools (`PLAIN_TEMPLATE`)."""
    from mas_async.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = PLAIN_TEMPLATE
    return tokenizer


def tools_tokenizer() -> Any:
    """The tiny-ascii tokenizer (every printable character, so JSON tokenises) with `TOOLS_TEMPLATE`."""
    from mas_async.tiny_model import build_tokenizer

    tokenizer = build_tokenizer("tiny-ascii")
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer
