"""LoRA adapters of a policy (`policies.<p>.lora`), through peft, for the trainer and the inference servers.

The trainer and an hf inference server wrap the same base model with the same peft config, so their
adapter parameters have the same names and shapes: the weight sync sends those tensors only
(`adapter_parameters`), and a server applies them as they are. The vLLM backend serves the plain model
and merges each version's adapters into a master copy of the base weights, as the model folder stores
them (`merge_adapters`). A checkpoint of
a LoRA policy holds the merged model (a complete model folder, for eval and vLLM; `merged_from_master`,
the same merge, from the folder's weights and the adapters as the trainer keeps them) and, in ADAPTER_DIR,
the adapters (where a resumed run's trainer and servers start from).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from mas_async.config import LoraConfig
    from mas_async.deployment import Deployment

ADAPTER_DIR = "adapter"
"""Sub-folder of a LoRA policy's checkpoint that holds its adapters (peft's save_pretrained)."""
ADAPTER_NAME = "default"
"""peft's name of the single adapter a policy trains."""
_PREFIX = "base_model.model."
"""What peft puts in front of the wrapped model's parameter names."""


@dataclass(frozen=True)
class LoraSetup:
    """What a process needs to build a policy's model with adapters: the settings, the base model folder
    and the adapters to start from (None: fresh ones, whose B is zero, so the model is the base)."""

    r: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]
    base: str
    adapter: str | None = None

    @classmethod
    def of(cls, spec: LoraConfig, base: str, adapter: str | None = None) -> LoraSetup:
        return cls(spec.r, spec.alpha, spec.dropout, tuple(spec.target_modules), base, adapter)

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def peft_config(self) -> Any:
        from peft import LoraConfig as PeftLoraConfig

        return PeftLoraConfig(
            r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=list(self.target_modules),
            bias="none", task_type="CAUSAL_LM",
        )  # fmt: skip


def starting_point(deployment: Deployment, policy: str, spec: LoraConfig | None) -> tuple[str, LoraSetup | None]:
    """(the model folder a process of `policy` loads, its LoRA setup or None). Without LoRA the folder is
    the policy's starting weights (its model, or the checkpoint a resumed run starts from). With LoRA the
    model loaded is the base; a resumed run's adapters come from the checkpoint's ADAPTER_DIR."""
    weights = deployment.weights_path(policy)
    if policy in deployment.weights_paths and not Path(weights).is_dir():
        raise FileNotFoundError(
            f"policy {policy}: the weights this process starts from, {weights}, are gone (a checkpoint deleted "
            "while the run's deployment still starts from it?)"
        )
    if spec is None:
        return weights, None
    base = deployment.model_paths[policy]
    adapter = Path(weights) / ADAPTER_DIR
    return base, LoraSetup.of(spec, base, str(adapter) if weights != base and adapter.is_dir() else None)


def with_adapters(model: torch.nn.Module, setup: LoraSetup, trainable: bool) -> torch.nn.Module:
    """`model` (the base) wrapped by peft: fresh adapters, or those saved in `setup.adapter`. Only the
    adapters require gradients."""
    from peft import PeftModel, get_peft_model

    if setup.adapter is not None:
        return PeftModel.from_pretrained(model, setup.adapter, is_trainable=trainable)
    wrapped = get_peft_model(model, setup.peft_config())
    if not trainable:
        wrapped.requires_grad_(False)
    return wrapped


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapter parameters of a peft-wrapped model, in `named_parameters()` order."""
    found = [(name, p) for name, p in model.named_parameters() if is_adapter(name)]
    if not found:
        raise ValueError("the model has no LoRA adapter parameters (no target module matched?)")
    return found


def merged_model(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of a peft-wrapped `model` with its adapters merged into the base weights (a plain model), in
    the model's own dtypes (peft's merge: a bf16 base is rounded before the delta is added; a checkpoint
    uses `merged_from_master`)."""
    import copy

    return copy.deepcopy(model).merge_and_unload()


def merged_from_master(
    setup: LoraSetup, adapters: list[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> torch.nn.Module:
    """The plain model of `setup.base` with `adapters` merged, on the host, in `dtype` (what the servers
    serve): every adapted weight is W + scale * B @ A computed in float32 from the model folder's own W and
    the adapters as the trainer keeps them (float32 master), then cast (`merge_adapters`, as the vLLM
    worker merges); every other weight is the folder's, cast. A trainer holding its frozen base in bf16
    would otherwise merge into the rounded base and drop a delta below half a bf16 step."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(setup.base, dtype="auto")  # the folder's own dtype
    merged = merge_adapters(dict(model.state_dict()), [(n, t.detach().cpu()) for n, t in adapters], setup.scale, dtype)
    model.to(dtype)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, weight in merged.items():
            params[name].copy_(weight)
    return model


def base_weight_name(adapter_name: str) -> tuple[str, str]:
    """(the base model's weight the adapter tensor belongs to, "A" or "B"), e.g.
    base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight -> (model.layers.0.mlp.up_proj.weight, A)."""
    name = adapter_name.removeprefix(_PREFIX)
    for part in ("A", "B"):
        module, marker, rest = name.partition(f".lora_{part}.")
        if marker and rest in (f"{ADAPTER_NAME}.weight", "weight"):
            return f"{module}.weight", part
    raise ValueError(f"{adapter_name!r} is not the name of a LoRA A or B weight")


def merge_adapters(
    base: dict[str, torch.Tensor], adapters: list[tuple[str, torch.Tensor]], scale: float, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The weights of `base` that have adapters, each W + scale * B @ A computed in float32 and returned in
    `dtype` (the engine's). `base` is the master copy: the weights as the model folder stores them, never
    rounded to `dtype` first. A delta below `dtype`'s resolution then still moves the served weights as
    rounding W + delta would (a bf16 engine loading the merged float32 model holds exactly the result),
    where rounding W first would keep every such entry at round(W): bf16 has 8 bits of mantissa, so a
    2e-6 delta on weights of ~0.02 (a step of 1.2e-4 there) would vanish from every entry. Every adapted
    weight needs both its A and its B."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapters:
        weight, part = base_weight_name(name)
        if weight not in base:
            raise ValueError(f"adapter {name!r} belongs to {weight!r}, which the base model does not have")
        pairs.setdefault(weight, {})[part] = tensor
    merged = {}
    for weight, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{weight!r} has a LoRA {''.join(pair)} without its other half")
        w = base[weight]
        delta = scale * (pair["B"].float() @ pair["A"].float())
        merged[weight] = (w.float() + delta.to(w.device)).to(dtype)
    return merged


def adapter_manifest(setup: LoraSetup, dtype: torch.dtype) -> list[tuple[str, list[int], str]]:
    """(name, shape, dtype) of the adapter tensors a trainer sends, from the base model's config alone
    (the model is built on the meta device: no weight is read or allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mas_async.weights.group import dtype_name

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(setup.base), dtype=dtype)
        wrapped = with_adapters(model, LoraSetup(**{**asdict(setup), "adapter": None}), trainable=False)
    return [(name, list(p.shape), dtype_name(p.dtype)) for name, p in adapter_parameters(wrapped)]


def saved_adapters(folder: str) -> list[tuple[str, torch.Tensor]]:
    """The adapter tensors peft saved in `folder` (names without the adapter's name, as peft writes them)."""
    from safetensors.torch import load_file

    return list(load_file(str(Path(folder) / "adapter_model.safetensors")).items())
