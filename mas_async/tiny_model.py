"""The built-in tiny models and their offline character-level tokenizer.

Tests and the CPU demo cannot download anything, so the launcher materialises a model folder once with
`materialise("builtin:tiny-char", cache_dir)` and every process (env workers, trainers, inference
servers, vLLM) loads the same files by path: config.json, generation_config.json, model.safetensors
and the tokenizer files, exactly the layout of a model from a hub.

The tokenizer maps one character to one token. Its vocabulary is fixed (ids never move):

    0 <|endoftext|> (eos, pad)  1 <|im_start|>  2 <|im_end|>  3 <unk>
    4 system  5 user  6 assistant   (whole-word added tokens, for the chat template)
    7.. "\\n", " ", "0"-"9", ". # : , = -", "A"-"Z"

and its chat template is Qwen's: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message (with tools, Qwen2.5's
tool turns: `CHAT_TEMPLATE`).
The "tiny-ascii" preset has the same ids 0-6, then "\\n", "\\t" and every printable ASCII character
(space to "~"), so that code and math prompts tokenize without <unk>.

The models are Qwen3-architecture presets with weights drawn from a seeded generator in a fixed
parameter order, so the same preset and seed always give bit-identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END, UNK_TOKEN]
ROLE_TOKENS = ["system", "user", "assistant"]
CHARACTERS = ["\n", " ", *"0123456789", *".#:,=-", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ"]
VOCAB = [*SPECIAL_TOKENS, *ROLE_TOKENS, *CHARACTERS]
ASCII_CHARACTERS = ["\n", "\t", *(chr(code) for code in range(32, 127))]
ASCII_VOCAB = [*SPECIAL_TOKENS, *ROLE_TOKENS, *ASCII_CHARACTERS]

EOS_ID = VOCAB.index(EOS_TOKEN)
IM_START_ID = VOCAB.index(IM_START)
IM_END_ID = VOCAB.index(IM_END)

CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\n<tools>' }}{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if message['content'] or not loop.first %}{{ '\\n' }}{%- endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson }}{{ '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen's ChatML (Qwen2.5's shape): `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message; with `tools`, a
first system turn lists them as JSON (after the system message's own text), an assistant's tool calls are
Hermes `<tool_call>` blocks and tool results `<tool_response>` user turns, so a workflow program's function
tools reach the model (docs/gateway.md, "Tools"). Without tools it renders exactly the plain ChatML."""

BUILTIN_PREFIX = "builtin:"
# Bump when the way files are produced changes, so old cache folders are not reused.
_FORMAT_VERSION = 3


@dataclass(frozen=True)
class Preset:
    """Shape of a built-in Qwen3 model (the vocabulary is always the tokenizer's)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True


PRESETS: dict[str, Preset] = {
    # ~77k parameters: fast enough for unit tests and the CPU demo.
    # Heads of 32 dimensions: vLLM's CPU attention takes only head sizes that are multiples of 32.
    "tiny-char": Preset(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
    ),
    # ~0.8M parameters: for CPU benchmarks that need a model with some weight.
    "small-char": Preset(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
    ),
    # tiny-char's shape with a printable-ASCII vocabulary and room for long prompts (code, math).
    "tiny-ascii": Preset(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        max_position_embeddings=8192,
    ),
    # ~104M parameters (GPT-2-small's width and depth): the GPU check's throughput and weight-sync model.
    "100m-char": Preset(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=3072,
        max_position_embeddings=2048,
    ),
}
# The vocabulary of each preset (ids never move); presets not listed use VOCAB.
PRESET_VOCABS: dict[str, list[str]] = {"tiny-ascii": ASCII_VOCAB}


def vocabulary(preset: str) -> list[str]:
    """The token list of a preset's tokenizer (index = token id)."""
    return PRESET_VOCABS.get(preset, VOCAB)


def build_tokenizer(preset: str = "tiny-char") -> PreTrainedTokenizerFast:
    """A preset's character-level tokenizer, as a transformers fast tokenizer (no files needed)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    # A BPE model without merges splits text into single characters; unknown ones become <unk>.
    backend = Tokenizer(
        models.BPE(vocab={tok: i for i, tok in enumerate(vocabulary(preset))}, merges=[], unk_token=UNK_TOKEN)
    )
    backend.decoder = decoders.Fuse()  # join characters without spaces
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in ROLE_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
    )


def _preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown built-in model preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[name]


def build_config(preset: str) -> Qwen3Config:
    """The `Qwen3Config` of a preset, fp32, with the tokenizer's vocabulary and special ids."""
    from transformers import Qwen3Config

    p = _preset(preset)
    return Qwen3Config(
        vocab_size=len(vocabulary(preset)),
        hidden_size=p.hidden_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        head_dim=p.head_dim,
        intermediate_size=p.intermediate_size,
        max_position_embeddings=p.max_position_embeddings,
        tie_word_embeddings=p.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        dtype="float32",
        architectures=["Qwen3ForCausalLM"],  # vLLM picks its model class from this
    )


def build_model(preset: str, seed: int = 0) -> Qwen3ForCausalLM:
    """A preset's model with weights drawn from `seed` (norm weights 1, everything else N(0, 0.02)).

    Parameters are filled in `named_parameters()` order from a private generator, so the result does
    not depend on (and does not disturb) the global torch RNG or transformers' own init scheme.
    """
    import torch
    from transformers import Qwen3ForCausalLM

    config = build_config(preset)
    with torch.random.fork_rng(devices=[]):
        model = Qwen3ForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                param.copy_(values * config.initializer_range)
    return model.eval()


def parameter_count(preset: str) -> int:
    """Number of parameters of a preset (tied embeddings counted once)."""
    return sum(p.numel() for p in build_model(preset).parameters())


def _folder_name(preset: str, seed: int) -> str:
    key = json.dumps(
        {"format": _FORMAT_VERSION, "preset": asdict(_preset(preset)), "seed": seed, "vocab": vocabulary(preset)},
        sort_keys=True,
    )
    return f"{preset}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def _write_tokenizer(folder: Path, preset: str) -> None:
    build_tokenizer(preset).save_pretrained(str(folder))
    # Name the generic fast-tokenizer class and inline the chat template, so that older
    # transformers versions (as pinned by vLLM) load the same files.
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (folder / "chat_template.jinja").unlink(missing_ok=True)


def _write_model(folder: Path, preset: str, seed: int) -> None:
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    model = build_model(preset, seed)
    model.config.save_pretrained(str(folder))
    GenerationConfig(eos_token_id=[IM_END_ID, EOS_ID], pad_token_id=EOS_ID).save_pretrained(str(folder))
    # named_parameters() lists the tied lm_head once, under the embedding's name, as HF checkpoints do.
    tensors = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def materialise(spec: str, cache_dir: Path, *, seed: int = 0) -> Path:
    """Return a local model folder for `spec`, writing it first for a built-in model.

    `"builtin:<preset>"` writes the preset's files into `cache_dir/<preset>-<hash>` once (the hash
    covers the preset, the seed and the vocabulary); an existing folder is reused. The files are
    written to a temporary folder and renamed into place, so concurrent callers never see a partial
    folder and a lost race simply reuses the winner's folder.
    Any other spec is a local model folder that must contain config.json.
    """
    if not spec.startswith(BUILTIN_PREFIX):
        folder = Path(spec).expanduser()
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"model {spec!r} is neither a built-in model ({BUILTIN_PREFIX}<preset>, presets: "
                f"{sorted(PRESETS)}) nor a local model folder with a config.json: {folder} "
                + ("has no config.json" if folder.is_dir() else "does not exist")
            )
        return folder

    preset = spec[len(BUILTIN_PREFIX) :]
    cache_dir = Path(cache_dir)
    final = cache_dir / _folder_name(preset, seed)
    if (final / "config.json").is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
    try:
        _write_model(tmp, preset, seed)
        _write_tokenizer(tmp, preset)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise  # not a lost race: a real error
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
