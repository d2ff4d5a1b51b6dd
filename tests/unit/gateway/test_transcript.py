"""Exact tokens across turns (mas_async/gateway/transcript.py): reuse of recorded ids, and each way a
request's history can fail to repeat what the model produced."""

from __future__ import annotations

import numpy as np

from mas_async.gateway.tools import template_messages
from mas_async.gateway.transcript import Transcript
from mas_async.rollout.chat_prompt import chat_prompt_ids
from mas_async.tiny_model import CHAT_TEMPLATE, IM_END_ID
from tests.unit.gateway.tokenizers import merging_tokenizer

USER = {"role": "user", "content": "GO"}
CALL = {"id": "1", "type": "function", "function": {"name": "move", "arguments": "{}"}}


def _first_turn(transcript: Transcript, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """The first call's prompt, and a sampled reply "UD" as two tokens U, D then <|im_end|>."""
    prompt = transcript.prompt([USER])
    assert prompt.source == "fresh"
    completion = np.asarray([*tokenizer.convert_tokens_to_ids(["U", "D"]), IM_END_ID], dtype=np.int32)
    transcript.add([USER], {"role": "assistant", "content": "UD"}, prompt, completion)
    return prompt.ids, completion


def test_a_new_conversation_is_the_chat_template_of_its_messages() -> None:
    tokenizer = merging_tokenizer()
    prompt = Transcript(tokenizer).prompt([USER])
    assert prompt.source == "fresh"
    assert prompt.ids.tolist() == chat_prompt_ids(tokenizer, [USER]).tolist()
    assert prompt.text == tokenizer.apply_chat_template([USER], add_generation_prompt=True, tokenize=False)


def test_a_repeated_exchange_reuses_the_sampled_ids_instead_of_retokenising() -> None:
    tokenizer = merging_tokenizer()
    transcript = Transcript(tokenizer)
    prompt, completion = _first_turn(transcript, tokenizer)
    messages = [USER, {"role": "assistant", "content": "UD"}, {"role": "user", "content": "AGAIN"}]
    reused = transcript.prompt(messages)
    ids, source = reused.ids, reused.source
    assert source == "reused"
    fresh = chat_prompt_ids(tokenizer, messages)
    # The model sampled U, D; re-tokenising the text "UD" would give the merged token instead.
    assert tokenizer.convert_tokens_to_ids("UD") in fresh.tolist()
    head = len(prompt) + len(completion)
    assert ids[:head].tolist() == [*prompt.tolist(), *completion.tolist()]
    # The rest is what the template writes after the reply: the turn's end, the new message, the generation prompt.
    assert tokenizer.decode(ids.tolist()) == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert reused.text == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ids.dtype == np.int32


def test_reuse_chains_over_several_turns() -> None:
    tokenizer = merging_tokenizer()
    transcript = Transcript(tokenizer)
    _first_turn(transcript, tokenizer)
    second = [USER, {"role": "assistant", "content": "UD"}, {"role": "user", "content": "AGAIN"}]
    prompt2 = transcript.prompt(second)
    ids2 = prompt2.ids
    reply2 = np.asarray(tokenizer.convert_tokens_to_ids(["U", "D"]), dtype=np.int32)  # cut by max_tokens: no end
    transcript.add(second, {"role": "assistant", "content": "UD"}, prompt2, reply2)
    third = [*second, {"role": "assistant", "content": "UD"}, {"role": "user", "content": "MORE"}]
    prompt3 = transcript.prompt(third)
    ids3, source = prompt3.ids, prompt3.source
    assert source == "reused"
    assert ids3[: len(ids2) + 2].tolist() == [*ids2.tolist(), *reply2.tolist()]
    assert tokenizer.decode(ids3.tolist()) == tokenizer.apply_chat_template(
        third, add_generation_prompt=True, tokenize=False
    )


def test_an_edited_reply_or_history_is_a_prefix_mismatch_and_is_tokenised_afresh() -> None:
    tokenizer = merging_tokenizer()
    transcript = Transcript(tokenizer)
    _first_turn(transcript, tokenizer)
    edits = [
        [USER, {"role": "assistant", "content": "U"}, {"role": "user", "content": "AGAIN"}],  # reply edited
        [{"role": "user", "content": "GO "}, {"role": "assistant", "content": "UD"}, {"role": "user", "content": "X"}],
        [{"role": "system", "content": "S"}, USER, {"role": "assistant", "content": "UD"}],  # a message inserted
        [USER, {"role": "assistant", "content": "UD", "tool_calls": [CALL]}],  # not the reply given
    ]
    for messages in edits:
        prompt = transcript.prompt(messages)
        ids, source = prompt.ids, prompt.source
        assert source == "edited", messages
        # (an OpenAI request's last assistant message is history: the gateway opens a new assistant turn after
        # it, where a node's trailing assistant message is a reply to continue, `chat_prompt_ids`)
        rendered = tokenizer.apply_chat_template(
            template_messages(messages), add_generation_prompt=True, tokenize=False
        )
        assert ids.tolist() == tokenizer.encode(rendered, add_special_tokens=False)


def test_a_template_that_rewrites_the_reply_is_retokenised_not_counted_as_an_edit() -> None:
    # A template that renders assistant turns in lower case (as a reasoning template drops a <think> block):
    # the history is the agent's own, but no recorded ids can be glued to what the template writes.
    template = CHAT_TEMPLATE.replace("message['content']", "(message['content'] | lower)")
    tokenizer = merging_tokenizer(template)
    transcript = Transcript(tokenizer)
    _first_turn(transcript, tokenizer)
    messages = [USER, {"role": "assistant", "content": "UD"}, {"role": "user", "content": "AGAIN"}]
    prompt = transcript.prompt(messages)
    ids, source = prompt.ids, prompt.source
    assert source == "retokenized"
    assert ids.tolist() == chat_prompt_ids(tokenizer, messages).tolist()
