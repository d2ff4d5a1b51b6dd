"""The built-in tiny models: tokenizer ids and chat template, deterministic materialisation, sizes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mas_async import tiny_model
from mas_async.tiny_model import VOCAB, build_tokenizer, materialise, parameter_count


def _ids(encoded: object) -> list[int]:
    """apply_chat_template returns a list in transformers 4 and may return a BatchEncoding in 5."""
    if isinstance(encoded, list):
        return encoded
    return list(encoded["input_ids"])  # type: ignore[index]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialise("builtin:tiny-char", tmp_path_factory.mktemp("models"))


def test_vocabulary_order_is_fixed() -> None:
    tok = build_tokenizer()
    assert len(tok) == len(VOCAB) == 51
    expected = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<unk>": 3}
    expected |= {"system": 4, "user": 5, "assistant": 6, "\n": 7, " ": 8, "0": 9, "9": 18, ".": 19, "-": 24}
    expected |= {"A": 25, "Z": 50}
    assert {t: tok.convert_tokens_to_ids(t) for t in expected} == expected
    assert tok.eos_token_id == 0 and tok.pad_token_id == 0


def test_encode_decode_round_trip() -> None:
    tok = build_tokenizer()
    text = "MOVE 12,3: A=B.\n# -9"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok("x")["input_ids"] == [3]  # unknown characters map to <unk>


def test_saved_tokenizer_chat_template(folder: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": "GO"}, {"role": "user", "content": "A 1"}]
    ids = _ids(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
    g, o, a, one = (VOCAB.index(c) for c in "GOA1")
    assert ids == [1, 4, 7, g, o, 2, 7, 1, 5, 7, a, 8, one, 2, 7, 1, 6, 7]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nGO<|im_end|>\n<|im_start|>user\nA 1<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids, skip_special_tokens=True) == "system\nGO\nuser\nA 1\nassistant\n"


def test_materialise_writes_a_loadable_model_folder(folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert folder.name.startswith("tiny-char-")
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.vocab_size == len(VOCAB)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == parameter_count("tiny-char")


def test_materialise_is_deterministic_and_reuses_the_folder(folder: Path, tmp_path: Path) -> None:
    weights = (folder / "model.safetensors").read_bytes()
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert materialise("builtin:tiny-char", folder.parent) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rewritten
    again = materialise("builtin:tiny-char", tmp_path)
    assert again.name == folder.name
    assert (again / "model.safetensors").read_bytes() == weights
    other_seed = materialise("builtin:tiny-char", tmp_path, seed=1)
    assert other_seed != again
    assert (other_seed / "model.safetensors").read_bytes() != weights


def test_concurrent_materialise_agrees(tmp_path: Path) -> None:
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda _: materialise("builtin:tiny-char", tmp_path), range(2))
    assert a == b and (a / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [a.name]  # no temporary folders left behind


def test_parameter_counts() -> None:
    assert 50_000 < parameter_count("tiny-char") < 150_000
    assert 500_000 < parameter_count("small-char") < 1_500_000


def test_bad_specs_are_explained(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="huge-char.*tiny-char"):
        materialise("builtin:huge-char", tmp_path)
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=str(missing)):
        materialise(str(missing), tmp_path)
    with pytest.raises(ValueError, match="no config.json"):
        materialise(str(tmp_path), tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert materialise(str(tmp_path), tmp_path / "cache") == tmp_path
    assert tiny_model.PRESETS["tiny-char"].hidden_size == 64
