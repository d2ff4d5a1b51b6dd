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
