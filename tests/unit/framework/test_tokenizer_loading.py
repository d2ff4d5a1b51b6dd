"""`load_tokenizer` loads the class a model folder names, without AutoTokenizer's import of every model
family, and gives the same tokenizer AutoTokenizer would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mas_async.rollout.env_worker import load_tokenizer, stop_token_ids

MESSAGES = [{"role": "user", "content": "Move the box up. 3x3 grid: é ✓"}]


def test_the_same_tokenizer_as_autotokenizer(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(str(tiny_model)), AutoTokenizer.from_pretrained(str(tiny_model))
    assert type(ours) is type(auto)
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True) == auto.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True
    )
    assert stop_token_ids(ours) == stop_token_ids(auto)


def test_loading_does_not_import_every_model_family(tiny_model: Path) -> None:
    code = (
        "import sys; from mas_async.rollout.env_worker import load_tokenizer; "
        f"load_tokenizer({str(tiny_model)!r}); print('transformers.models.auto.tokenization_auto' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_a_class_transformers_lacks_falls_back_to_autotokenizer(tiny_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    for f in tiny_model.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": "NoSuchTokenizer"}))
    tokenizer = load_tokenizer(str(folder))
    assert tokenizer("abc")["input_ids"] == load_tokenizer(str(tiny_model))("abc")["input_ids"]
