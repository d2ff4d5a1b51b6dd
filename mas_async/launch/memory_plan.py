"""The memory plan of a run's GPU processes: what each needs of its GPU, checked before anything starts.

The dry run (`--dry-run`, `mas_async.launch.dry_run`) and the launch of a GPU config both ask it. Every process
on a GPU gets a figure and the room it has (its GPU's memory, `--gpu-memory-gib`, times its `cluster.gpu_shares`
share or, for a vLLM server, its `gpu_memory_utilization`); one that does not fit is a `ConfigError` naming the
process, the figure, the GPU's memory and what to change.

- **A trainer rank**: the peak of the project's own training step at the real model shape, run on fake tensors
  (`trainer_memory.trainer_peak`: no byte is allocated), plus `MARGIN_FRACTION` of it and `MARGIN_BYTES` for
  what a step's tensors leave out: the CUDA context, cuBLAS and NCCL workspaces, the allocator's fragmentation.
  Ranks are alike under DDP and the distributed optimiser (its N shards are equal: rank 0 is planned); under
  `trainer.zero` (ZeRO-1 shards whole parameters) rank 0 and the last rank are, and the larger counts. Policies
  with the same model and settings are planned once.
- **A vLLM server**: the engine arguments it will really get (`vllm_compat.engine_arguments` over
  `vllm_args.engine_args`), its weights (parameters x the served dtype), the weight sync's receive buffers
  (one copy of the model: vLLM's worker receives into one buffer set and reloads in place,
  `vllm_compat.weight_receive_bytes`), `VLLM_ACTIVATION_BYTES` for its profile run's activations and CUDA
  graphs, and the KV cache of one sequence of `max_model_len` tokens (vLLM refuses to start without room for
  it) must fit in `gpu_memory_utilization` of its GPU; the sequences of `prompt_tokens` + `rollout.max_tokens`
  its KV cache then holds at once are shown beside `max_num_seqs`.
- **An hf server on a GPU**: its weights and a second copy (it adopts each received version and receives the
  next into the other buffer set), plus the margin; its generation's KV cache is not planned.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mas_async.config import ConfigError
from mas_async.peer_names import role_and_policy

if TYPE_CHECKING:
    from mas_async.config import Config
    from mas_async.placement import Place

GIB = 2**30
DEFAULT_GPU_GIB = 80.0
"""The GPUs' memory where the dry run is not told (`--gpu-memory-gib`): an H100's or A100's 80 GB class."""
MARGIN_BYTES = 2 * GIB
"""Added to a trainer's or hf server's step peak: the CUDA context (~0.5 GiB with torch's kernels), cuBLAS's
workspaces and NCCL's buffers (~1 GiB over a group or two), which no tensor of the step holds."""
MARGIN_FRACTION = 0.05
"""Added to a step peak as a share of it: the caching allocator's fragmentation."""
VLLM_ACTIVATION_BYTES = 2 * GIB
"""A vLLM server's activations at its profile run and its CUDA graphs' pools, inside its share."""
VLLM_DEFAULT_UTILIZATION = 0.92
"""vLLM 0.32's `gpu_memory_utilization` where nothing sets it (`vllm_compat.DEFAULT_GPU_MEMORY_UTILIZATION`)."""
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass
class ProcessMemory:
    """One GPU process's figure and its room, in bytes."""

    name: str
    need: int
    """What it needs of its GPU, margins included."""
    room: int
    """What it may take: its GPU's memory, times its share (a vLLM server: its `gpu_memory_utilization`)."""
    room_why: str
    """How the room was found, in words ("80.0 GiB GPU", "share 0.4 of an 80.0 GiB GPU")."""
    parts: dict[str, int] = field(default_factory=dict)
    """What the need is made of, by name."""
    note: str = ""
    """What else the plan says of it (a vLLM server's concurrent sequences)."""
    fix: str = ""
    """What to change when it does not fit."""
    engine_args: dict[str, Any] | None = None
    """A vLLM server's engine arguments, as vLLM will be given them."""

    @property
    def fits(self) -> bool:
        return self.need <= self.room

    def line(self) -> str:
        parts = ", ".join(f"{k} {gib(v)}" for k, v in self.parts.items())
        verdict = "fits" if self.fits else "DOES NOT FIT"
        note = f"; {self.note}" if self.note else ""
        return f"{self.name}: {gib(self.need)} GiB of {gib(self.room)} GiB ({self.room_why}): {verdict} [{parts}]{note}"

    def as_json(self) -> dict[str, Any]:
        return {
            "need_gib": gib(self.need), "room_gib": gib(self.room), "fits": self.fits, "room": self.room_why,
            "parts_gib": {k: gib(v) for k, v in self.parts.items()}, **({"note": self.note} if self.note else {}),
        }  # fmt: skip


def gib(n: float) -> float:
    return round(n / GIB, 2)


def with_margin(peak: int) -> int:
    """A step peak with the margins (`MARGIN_FRACTION`, `MARGIN_BYTES`)."""
    return int(peak * (1 + MARGIN_FRACTION)) + MARGIN_BYTES


def on_gpu(place: Place) -> bool:
    return bool(place.gpus) or place.device.startswith("cuda")


def plan_memory(
    config: Config,
    places: dict[str, Place],
    gpu_bytes: int,
    prompt_tokens: int,
    model_config_of: Any = None,
    training: bool = True,
) -> dict[str, ProcessMemory]:
    """Every GPU process of `places` with its figure (module docstring), in `places`' order; `model_config_of`
    (spec -> config.json dict) defaults to `mas_async.model_source.model_config`."""
    if model_config_of is None:
        from mas_async.model_source import model_config as model_config_of
    configs: dict[str, dict] = {}
    peaks: dict[str, int] = {}
    out: dict[str, ProcessMemory] = {}
    for name, place in places.items():
        role, policy = role_and_policy(name)
        if role not in ("trainer", "inference") or not on_gpu(place):
            continue
        if role == "trainer" and not training:
            continue
        spec = config.policies[policy]
        if spec.model not in configs:
            configs[spec.model] = model_config_of(spec.model)
        model_cfg = configs[spec.model]
        room = int(gpu_bytes * (place.share or 1.0))
        room_why = _room_words(gpu_bytes, place.share)
        if role == "trainer":
            key = _trainer_key(config, policy, prompt_tokens)
            if key not in peaks:
                peaks[key] = _policy_peak(config, policy, model_cfg, prompt_tokens)
            peak = peaks[key]
            out[name] = ProcessMemory(
                name, with_margin(peak), room, room_why,
                {"step peak": peak, "margin": with_margin(peak) - peak}, fix=_trainer_fix(config, policy, place),
            )  # fmt: skip
        elif spec.backend == "vllm":
            out[name] = _vllm_memory(config, name, model_cfg, gpu_bytes, prompt_tokens)
        else:
            weights = parameter_count(model_cfg) * _DTYPE_BYTES[spec.dtype]
            out[name] = ProcessMemory(
                name, with_margin(2 * weights), room, room_why,
                {"weights": weights, "received copy": weights, "margin": with_margin(2 * weights) - 2 * weights},
                note="its KV cache is not planned", fix=f"policies.{policy}.dtype, cluster.gpu_shares",
            )  # fmt: skip
    return out


def check_memory(plan: dict[str, ProcessMemory], gpu_words: str) -> None:
    """Refuse the first process that does not fit its room: a sentence with the figure and what to change."""
    for memory in plan.values():
        if not memory.fits:
            raise ConfigError(
                f"{memory.name} needs {gib(memory.need)} GiB of GPU memory (the memory plan: "
                f"{', '.join(f'{k} {gib(v)}' for k, v in memory.parts.items())} GiB), more than the "
                f"{gib(memory.room)} GiB it has ({memory.room_why}; {gpu_words}); change {memory.fix}"
            )


def parameter_count(model_cfg: dict) -> int:
    """Parameters of the model of a config.json (tied ones once), built on the meta device."""
    return _parameter_count(json.dumps(model_cfg, sort_keys=True))


_COUNTS: dict[str, int] = {}


def _parameter_count(text: str) -> int:
    if text not in _COUNTS:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model(**json.loads(text))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        _COUNTS[text] = sum(p.numel() for p in model.parameters())
    return _COUNTS[text]


def kv_bytes_per_token(model_cfg: dict, dtype_bytes: int) -> int:
    """K and V of one token over every layer."""
    text = model_cfg.get("text_config", model_cfg)
    heads = text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    return 2 * text["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def _vllm_memory(config: Config, name: str, model_cfg: dict, gpu_bytes: int, prompt_tokens: int) -> ProcessMemory:
    from mas_async.inference.backends.vllm_args import engine_args
    from mas_async.inference.backends.vllm_compat import engine_arguments
    from mas_async.weights.flat_params import HEADROOM_BYTES

    policy = name.split("/")[1]
    spec = config.policies[policy]
    params = parameter_count(model_cfg)
    dtype_bytes = _DTYPE_BYTES[spec.dtype]
    weights = params * dtype_bytes
    receive = weights + HEADROOM_BYTES if spec.lora is None else 0
    asked = dict(engine_args(config, name))
    utilization = asked.get("gpu_memory_utilization") or VLLM_DEFAULT_UTILIZATION
    try:
        args = engine_arguments(
            spec.model, model_cfg, dtype=spec.dtype, max_num_seqs=spec.max_batch_sequences, seed=config.run.seed,
            on_cpu=False, receive_bytes=receive, gpu_bytes=gpu_bytes, overrides=asked,
        )  # fmt: skip
    except ValueError as e:
        raise ConfigError(f"{name}: {e}") from e
    args = {k: v for k, v in args.items() if k not in ("worker_extension_cls",)}
    text = model_cfg.get("text_config", model_cfg)
    max_len = args.get("max_model_len") or text.get("max_position_embeddings") or 0
    kv_dtype = args.get("kv_cache_dtype", "auto")
    per_token = kv_bytes_per_token(model_cfg, dtype_bytes if kv_dtype == "auto" else _DTYPE_BYTES.get(kv_dtype, 1))
    one_sequence = per_token * max_len
    room = int(gpu_bytes * utilization)
    fixed = weights + receive + VLLM_ACTIVATION_BYTES
    kv_room = room - fixed
    sequence = prompt_tokens + config.rollout.max_tokens
    held = max(0, kv_room) // (per_token * sequence) if per_token else 0
    memory = ProcessMemory(
        name, fixed + one_sequence, room, f"gpu_memory_utilization {utilization:g} of a {gib(gpu_bytes)} GiB GPU",
        {"weights": weights, "receive buffers": receive, "activations": VLLM_ACTIVATION_BYTES,
         f"KV of one {max_len}-token sequence": one_sequence},
        note=f"KV cache {gib(max(0, kv_room))} GiB: {held} sequences of {sequence} tokens at once "
        f"(max_num_seqs {args.get('max_num_seqs')})",
        fix=f"policies.{policy}.vllm.gpu_memory_utilization or cluster.gpu_shares (more share), "
        f"policies.{policy}.vllm.max_model_len (shorter)",
        engine_args=args,
    )  # fmt: skip
    return memory


def _policy_peak(config: Config, policy: str, model_cfg: dict, prompt_tokens: int) -> int:
    """The largest planned step peak over the policy's ranks that differ (module docstring)."""
    from mas_async.launch.trainer_memory import trainer_peak

    key = _trainer_key(config, policy, prompt_tokens) + json.dumps(model_cfg, sort_keys=True)
    if key in _PEAKS:
        return _PEAKS[key]
    world = config.policies[policy].trainer_ranks
    # ZeRO-1 shards by whole parameters (rank 0 owns the embedding's state); the distributed optimiser pads its
    # buffers to N equal shards, so its ranks are alike, as DDP's are.
    uneven = world > 1 and config.trainer.zero and not getattr(config.trainer, "distributed_optimizer", False)
    ranks = sorted({0, world - 1}) if uneven else [0]
    _PEAKS[key] = max(trainer_peak(config, policy, model_cfg, rank, prompt_tokens).peak for rank in ranks)
    return _PEAKS[key]


_PEAKS: dict[str, int] = {}
"""Planned peaks of this process, by policy settings and model: a policy like one already planned is not again."""


def _trainer_key(config: Config, policy: str, prompt_tokens: int) -> str:
    spec = config.policies[policy].model_dump(exclude={"replicas", "chat_template_kwargs", "server_device", "base"})
    spec.pop("device", None)
    spec.pop("trainer_devices", None)
    return json.dumps(
        [spec, config.trainer.model_dump(), config.algorithm.model_dump(), config.rollout.max_tokens,
         config.rollout.max_staleness, prompt_tokens],
        sort_keys=True, default=str,
    )  # fmt: skip


def _trainer_fix(config: Config, policy: str, place: Place) -> str:
    """What lowers a trainer rank's figure, for its sentence."""
    fixes = []
    if not config.trainer.activation_checkpointing:
        fixes.append("trainer.activation_checkpointing=true")
    fixes.append("trainer.max_tokens_per_micro_batch (lower)")
    ranks = config.policies[policy].trainer_ranks
    if hasattr(config.trainer, "distributed_optimizer") and not config.trainer.distributed_optimizer:
        fixes.append(f"trainer.distributed_optimizer=true with policies.{policy}.trainer_ranks > 1 (now {ranks})")
    elif not config.trainer.zero:
        fixes.append(f"trainer.zero=true with policies.{policy}.trainer_ranks > 1 (now {ranks})")
    if place.share is not None:
        fixes.append(f"cluster.gpu_shares (a larger share than {place.share:g})")
    return ", ".join(fixes)


def _room_words(gpu_bytes: int, share: float | None) -> str:
    return f"share {share:g} of a {gib(gpu_bytes)} GiB GPU" if share is not None else f"a {gib(gpu_bytes)} GiB GPU"
