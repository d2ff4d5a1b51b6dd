"""Every call into vLLM whose shape depends on its version, in one place (supported: 0.32.x).

The vLLM backend (`vllm_backend.py`) talks to vLLM only through this module: engine construction,
sampling parameters, reading the sampled tokens' log-probs back, and the weight update. A new vLLM
release should only ever need changes here (and the pin in pyproject.toml).

The process layout. `AsyncLLM` always runs vLLM's engine core in a process of its own beside the inference
server (its client talks to it over ZeroMQ), on a CPU as on a GPU. The model runs in a worker: inside the
engine-core process with the "uni" executor (vLLM's choice for one GPU, and this module's default on a CPU,
where it needs VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's CPU platform turns "uni" into "mp" otherwise), or
in a process of its own with the "mp" executor (vLLM's choice for tensor parallelism; on a CPU with
`distributed_executor_backend: mp` in `policies.<p>.vllm.engine_args`, which the tests use to run that
layout: the worker's calls then cross two process boundaries, server -> engine core -> worker). On a GPU
the model is also compiled (torch.compile) and its decoding captured in CUDA graphs unless
`enforce_eager`; the reload below writes the weights in place, so the graphs see the new ones.

How a weight update reaches the model. vLLM mixes `WeightSyncExtension` into the worker class, so its
methods can be called with `collective_rpc` (through the engine core, into whichever process the worker
is in):
- `mas_join_weight_group` opens the policy's weight receiver (`mas_async.weights.sync`) from inside the
  worker, with the same TCPStore + PrefixStore + ProcessGroupGloo/NCCL objects as every other rank.
  (`init_process_group` cannot be used there: vLLM already owns the default group.) The config never
  gives a vLLM policy cuda_ipc: vLLM places its engine itself, so nothing says it shares the trainer's GPU.
  A worker of an engine split over several GPUs (tensor or pipeline parallelism) refuses to join: each of
  its workers would join as the server's one rank.
- The receiver's buffers (one copy of the model, `weight_receive_bytes`) are allocated on the worker's GPU
  at the first update, after vLLM took its share of the GPU: `engine_arguments` takes them out of that
  share (`gpu_memory_utilization`), so the engine and the buffers together stay within what was asked.
- `mas_load_weights` receives every tensor of one broadcast first (checked against the checkpoint's
  names and shapes and the engine's dtype), and only then loads them with the worker's
  `reload_weights(is_checkpoint_format=True)`, vLLM's layer-wise in-place reload, which fuses q/k/v
  and gate/up and re-runs the per-layer post-processing (on CPU: the oneDNN weight packing). A
  failure half-way through a reload would leave layers on the meta device, so nothing is loaded
  unless every tensor arrived and matched.
- With LoRA (`mas_use_lora`), a broadcast carries the policy's adapters only: the worker keeps the base
  weights on the host as the model folder stores them (a float32 folder stays float32: rounded to a bf16
  engine's dtype first, a delta below bf16's resolution would vanish), merges each version's adapters
  into them (W + alpha/r * B @ A, in float32, then the engine's dtype) and reloads the whole model with
  the result, the same reload as above (docs/lora.md says why merged, not served as vLLM LoRA adapters).
- A tied `lm_head` shares the embedding's storage but keeps its own post-processed copy on CPU;
  nothing is loaded into it, so its post-processing is re-run explicitly after the reload.
The caller then resets the prefix cache (`reset_prefix_cache`): cached KV blocks were computed by
the old weights and must never serve a request of the new version.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from mas_async.startup import VLLM_START_TIMEOUT_S
from mas_async.weights.group import GroupRetired, ManifestMismatch, WeightSyncError, dtype_name
from mas_async.weights.sync import open_receiver, retire_replaced

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.outputs import CompletionOutput
    from vllm.v1.engine.async_llm import AsyncLLM

    from mas_async.inference.request import GenerationRequest
    from mas_async.lora import LoraSetup

SUPPORTED_VERSIONS = (0, 32)
"""The vLLM minor release this module is written against (pyproject pins vllm>=0.32,<0.33)."""

_WORKER_EXTENSION = "mas_async.inference.backends.vllm_compat.WeightSyncExtension"
_CPU_ATTENTION_HEAD_MULTIPLE = 32  # vLLM's CPU attention kernels support head sizes 32, 64, 80, ...


def check_version() -> None:
    """Raise a clear error when the installed vLLM is not the supported release."""
    import vllm

    major_minor = tuple(int(x) for x in vllm.__version__.split(".")[:2])
    if major_minor != SUPPORTED_VERSIONS:
        raise RuntimeError(
            f"the vllm backend supports vLLM {SUPPORTED_VERSIONS[0]}.{SUPPORTED_VERSIONS[1]}.x, "
            f"but vLLM {vllm.__version__} is installed (pip install 'mas-async[vllm]')"
        )


def _model_config(model_path: str) -> dict[str, Any]:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise ValueError(f"the vllm backend needs a local model folder with a config.json: {path} does not exist")
    return json.loads(path.read_text())


def _causal_lm_architecture(config: dict[str, Any]) -> list[str] | None:
    """The architecture to run when config.json does not name one (e.g. a config saved without its
    model): the causal-LM class transformers registers for the config's model_type."""
    if config.get("architectures"):
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type", ""))
    if name is None:
        raise ValueError(
            f"config.json names no architecture and model_type {config.get('model_type')!r} has no causal LM"
        )
    return [name]


def _check_cpu_model(model_path: str, config: dict[str, Any]) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim % _CPU_ATTENTION_HEAD_MULTIPLE != 0:
        raise ValueError(
            f"vLLM's CPU attention supports head sizes that are multiples of {_CPU_ATTENTION_HEAD_MULTIPLE}; "
            f"the model in {model_path} has head_dim {head_dim}. Use the hf backend for it, or a model "
            f"with head_dim 32, 64, ... (e.g. builtin:small-char)"
        )


_CPU_ENVIRONMENT = {
    # KV cache size in GiB; without it vLLM reserves a fraction of all the machine's memory.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # Several engines and trainers share the cores: do not pin OpenMP threads to them.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # vLLM compiles a small log-prob helper with inductor on first use (~30 s on CPU); eager is fine.
    "TORCH_COMPILE_DISABLE": "1",
}
ENGINE_READY_MARGIN_S = 60
"""vLLM's own wait for its engine core to start (VLLM_ENGINE_READY_TIMEOUT_S, 600 s by default) is set this
much longer than the backend's bound (`mas_async.startup.VLLM_START_TIMEOUT_S`), so a slow cold start ends
with the backend's named error, not vLLM's."""


def engine_environment(on_cpu: bool, executor: str | None) -> dict[str, str]:
    """The environment vLLM reads while its engine starts (its processes inherit it). On a CPU, the "uni"
    executor (the worker inside the engine-core process: the fastest start) needs multiprocessing off,
    which vLLM's CPU platform reads to keep it; any other executor runs as vLLM does on a GPU. On a GPU,
    vLLM starts its processes by spawning them, never by forking this one (`_on_cpu` says why)."""
    env = {"VLLM_ENGINE_READY_TIMEOUT_S": str(int(VLLM_START_TIMEOUT_S + ENGINE_READY_MARGIN_S))}
    if on_cpu:
        env.update(_CPU_ENVIRONMENT)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if executor == "uni" else "1"
    else:
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    return env


def _on_cpu() -> bool:
    """Does vLLM run on the CPU here? vLLM's own answer (`current_platform`: the vllm-cpu build, or no GPU that
    NVML sees), which asks NVML and never CUDA.

    Never `torch.cuda.is_available()` in this process: on a CUDA build of torch it calls cudaGetDeviceCount
    (`torch._C._cuda_getDeviceCount`), which poisons fork for the process without initialising CUDA. vLLM
    forks its engine core unless CUDA is *initialised* (`get_mp_context`, `_maybe_force_spawn`), so the forked
    engine core would fail "Cannot re-initialize CUDA in forked subprocess" (docs/vllm.md)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@contextmanager
def _environment(defaults: dict[str, str]) -> Iterator[None]:
    """Set `defaults` where the environment has no value while the engine starts (vLLM reads them
    then, and its process inherits them); restore the environment afterwards."""
    added = [key for key in defaults if key not in os.environ]
    os.environ.update({key: defaults[key] for key in added})
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def start_engine(
    model_path: str, *, dtype: str, max_num_seqs: int, seed: int, receive_bytes: int = 0, **overrides: Any
) -> AsyncLLM:
    """Start vLLM's async engine on a local model folder.

    Must run in the thread whose event loop will drive the engine. `overrides` are extra
    `AsyncEngineArgs` fields (e.g. gpu_memory_utilization, enforce_eager) that win over the defaults.
    `receive_bytes`: the weight sync's receive buffers (`weight_receive_bytes`), which the worker allocates
    on the engine's GPU after vLLM reserved its share: taken out of that share (`engine_arguments`).
    """
    config = _model_config(model_path)
    on_cpu = _on_cpu()
    if on_cpu:
        _check_cpu_model(model_path, config)
    check_version()
    args = engine_arguments(
        model_path, config, dtype=dtype, max_num_seqs=max_num_seqs, seed=seed, on_cpu=on_cpu,
        receive_bytes=receive_bytes, gpu_bytes=0 if on_cpu or not receive_bytes else _gpu_total_bytes(),
        overrides=overrides,
    )  # fmt: skip
    # vLLM reads its environment when its modules load (VLLM_ENGINE_READY_TIMEOUT_S among them) and when the
    # engine starts: both happen inside.
    with _environment(engine_environment(on_cpu, args.get("distributed_executor_backend"))):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # Returned without a local name: a traceback that vLLM keeps from its start-up holds this frame,
        # and a local would keep the engine alive until interpreter teardown.
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))


DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
"""vLLM 0.32's default `gpu_memory_utilization` (`EngineArgs`)."""
MIN_GPU_MEMORY_UTILIZATION = 0.05
"""The least share left to vLLM once the receive buffers are taken out of it."""


def engine_arguments(
    model_path: str,
    config: dict[str, Any],
    *,
    dtype: str,
    max_num_seqs: int,
    seed: int,
    on_cpu: bool,
    receive_bytes: int,
    gpu_bytes: int,
    overrides: dict[str, Any],
) -> dict[str, Any]:
    """The `AsyncEngineArgs` fields of an engine: this backend's defaults, then `overrides`. On a GPU,
    `gpu_memory_utilization` (vLLM's share of the GPU, `gpu_bytes` in all, for weights, activations and KV
    cache) is lowered by the weight sync's receive buffers (`receive_bytes`), which vLLM does not see: the
    engine and the buffers together stay within the share asked for."""
    args: dict[str, Any] = {
        "model": model_path,
        "dtype": dtype,
        "seed": seed,
        "max_num_seqs": max_num_seqs,
        "runner": "generate",
        # The log-probs of the sampling distribution: after temperature (and top-k/top-p), as the
        # trainer computes them. The default ("raw_logprobs") would ignore the temperature.
        "logprobs_mode": "processed_logprobs",
        "enable_prefix_caching": True,
        "worker_extension_cls": _WORKER_EXTENSION,
        "disable_log_stats": True,
        "enforce_eager": on_cpu,
    }
    if on_cpu:
        args["distributed_executor_backend"] = "uni"
    architectures = _causal_lm_architecture(config)
    if architectures is not None:
        args["hf_overrides"] = {"architectures": architectures}
    args.update(overrides)
    if not on_cpu and receive_bytes and gpu_bytes:
        asked = args.get("gpu_memory_utilization") or DEFAULT_GPU_MEMORY_UTILIZATION
        share = asked - receive_bytes / gpu_bytes
        if share < MIN_GPU_MEMORY_UTILIZATION:
            raise ValueError(
                f"vLLM's gpu_memory_utilization {asked:g} leaves {share:.3f} of the GPU's {gpu_bytes / 2**30:.1f} GiB "
                f"once the weight sync's receive buffers ({receive_bytes / 2**30:.2f} GiB) are taken out: raise "
                f"policies.<p>.vllm.gpu_memory_utilization"
            )
        args["gpu_memory_utilization"] = share
    return args


def _gpu_total_bytes() -> int:
    """The memory of the engine's first GPU, read through NVML as vLLM does (CUDA is neither queried nor
    initialised in this process: `_on_cpu`)."""
    from vllm.platforms import current_platform

    return int(current_platform.get_device_total_memory(0))


def weight_receive_bytes(model_path: str, dtype: str) -> int:
    """The bytes of the weight sync's receive buffers in a worker: one copy of every tensor of the model's
    checkpoint (a tied lm_head once, as the embedding) in the engine's dtype, as the trainer sends them."""
    import torch

    from mas_async.weights.flat_params import HEADROOM_BYTES
    from mas_async.weights.group import torch_dtype

    config = _model_config(model_path)
    tied = config.get("tie_word_embeddings", False)
    numel = 0
    for path in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                if not (tied and name == "lm_head.weight"):
                    numel += int(torch.Size(f.get_slice(name).get_shape()).numel())
    return numel * torch_dtype(dtype).itemsize + HEADROOM_BYTES


def engine_died(engine: AsyncLLM | None) -> bool:
    """Has the engine's core process (or its output loop) died? (False for an engine not started yet.)"""
    return engine is not None and bool(engine.errored)


def max_model_len(engine: AsyncLLM) -> int:
    """The longest sequence (prompt + completion) the engine accepts."""
    return engine.model_config.max_model_len


def sampling_params(request: GenerationRequest) -> SamplingParams:
    """vLLM's parameters for one request: n samples, the sampled tokens' log-probs, token ids only.

    Generation stops only at the request's own stop ids (`ignore_eos`: the model's EOS is not added),
    exactly like the hf backend; a stop token is part of the returned ids. A greedy request asks for
    one sample (vLLM refuses n > 1 without sampling): its n samples would be identical anyway. A seed is
    vLLM's per-request seed: vLLM gives the i-th of the n samples seed + i (`ParentRequest`), as the hf
    backend does. `top_logprobs` = k asks vLLM for k alternatives per position (`logprobs=k`: the sampled
    token first, then the top k, under the engine's processed log-probs).
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    greedy = request.greedy or request.temperature == 0.0
    return SamplingParams(
        n=1 if greedy else request.n,
        max_tokens=request.max_tokens,
        temperature=0.0 if greedy else request.temperature,
        top_p=1.0 if greedy else request.top_p,
        seed=None if greedy else request.seed,
        stop_token_ids=list(request.stop_token_ids),
        ignore_eos=True,
        logprobs=request.top_logprobs,  # 0: only the sampled token's log-prob
        flat_logprobs=True,
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def sampled_logprobs(output: CompletionOutput) -> list[float]:
    """The log-prob of each sampled token of one completion, in order."""
    logprobs = output.logprobs
    if logprobs is None or len(logprobs) != len(output.token_ids):
        raise RuntimeError(f"vLLM returned {0 if logprobs is None else len(logprobs)} log-probs for "
                           f"{len(output.token_ids)} tokens")  # fmt: skip
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs: entry start_indices[i] is token i's
        starts = logprobs.start_indices
        if [logprobs.token_ids[s] for s in starts] != list(output.token_ids):
            raise RuntimeError("vLLM's log-probs do not belong to the sampled tokens")
        return [logprobs.logprobs[s] for s in starts]
    return [position[token].logprob for position, token in zip(logprobs, output.token_ids, strict=True)]


def top_logprobs(output: CompletionOutput, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The k alternatives of each position of one completion (ids, log-probs), most likely first.

    vLLM lists per position the sampled token (with its rank) and then the top k (ranks 1..k): flat, the
    entries after the position's first; as dicts, the entries of rank 1..k (the sampled token keeps its
    rank, so it is among them only if it is in the top k)."""
    logprobs = output.logprobs
    ids: list[list[int]] = []
    values: list[list[float]] = []
    if hasattr(logprobs, "start_indices"):
        for start, end in zip(logprobs.start_indices, logprobs.end_indices, strict=True):
            ids.append(list(logprobs.token_ids[start + 1 : end]))
            values.append(list(logprobs.logprobs[start + 1 : end]))
    else:
        for position in logprobs:
            top = sorted((e.rank, t, e.logprob) for t, e in position.items() if e.rank is not None and e.rank <= k)
            ids.append([token for _, token, _ in top])
            values.append([value for _, _, value in top])
    if any(len(row) != k for row in ids):
        raise RuntimeError(f"vLLM returned {sorted({len(row) for row in ids})} alternatives per position, not {k}")
    return ids, values


RETIRED = "retired: "
"""How the worker reports a receive abandoned in a retired or broken group across the RPC (its exceptions
do not travel as they are); the backend raises `GroupRetired` for it."""


async def join_weight_group(engine: AsyncLLM, **group: Any) -> None:
    """Make the engine's worker join the policy's weight group (blocks until every rank joined; raises
    GroupRetired when the trainer gives that generation up first)."""
    errors = await engine.collective_rpc("mas_join_weight_group", kwargs=group)
    _raise_retired(next((e for e in errors if e), ""))


async def use_lora(engine: AsyncLLM, setup: LoraSetup) -> None:
    """Make the engine's worker serve `setup`'s adapters, merged into its base weights (`mas_use_lora`)."""
    await engine.collective_rpc("mas_use_lora", kwargs={"setup": asdict(setup)})


async def load_weights(engine: AsyncLLM, version: int) -> str:
    """Receive the broadcast of `version` inside the worker, load it and reset the prefix cache.

    Returns "" on success, else why nothing was loaded (wrong version, or a manifest that does not
    match the model); the engine keeps its previous weights then.
    """
    errors = await engine.collective_rpc("mas_load_weights", kwargs={"version": version})
    error = next((e for e in errors if e), "")
    _raise_retired(error)  # nothing was loaded
    if not await engine.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache: requests were still running during the update")
    return error


def _raise_retired(error: str) -> None:
    if error.startswith(RETIRED):
        raise GroupRetired(error.removeprefix(RETIRED))


class WeightSyncExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); runs in the worker's process.

    Method names carry a `mas_` prefix: vLLM refuses an extension whose names clash with the worker's.
    """

    def mas_join_weight_group(
        self,
        *,
        policy: str,
        backend: str,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        generation: int = 0,
        join_timeout_s: float | None = None,
    ) -> str:
        parallel = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
            # Every worker would join as the same rank: refused before anything waits on it.
            raise ValueError(
                f"policy {policy!r}: a vLLM server of tensor_parallel_size {parallel.tensor_parallel_size} cannot "
                f"take weight updates (one rank of the weight group per server); train with "
                f"policies.<p>.vllm.tensor_parallel_size 1 and more replicas"
            )
        retire_replaced(getattr(self, "_mas_receiver", None))
        try:
            self._mas_receiver = open_receiver(
                policy=policy, backend=backend, host=host, port=port, rank=rank, world_size=world_size,
                timeout_s=timeout_s, generation=generation, join_timeout_s=join_timeout_s,
            )  # fmt: skip
        except GroupRetired as e:
            return RETIRED + str(e)
        return ""

    def mas_use_lora(self, setup: dict[str, Any]) -> None:
        """From now on updates carry the policy's LoRA adapters (`LoraSetup` fields): each is merged into
        the master copy of the base weights kept here on the host (in the folder's own dtype, not the
        engine's: `merge_adapters`), and the whole model is reloaded with them. A resumed run's adapters
        (`setup["adapter"]`) are merged in at once."""
        import torch

        from mas_async.lora import LoraSetup, adapter_manifest, saved_adapters

        lora = LoraSetup(**setup)
        model_config = self.vllm_config.model_config  # type: ignore[attr-defined]
        self._mas_lora = lora
        self._mas_lora_manifest = adapter_manifest(lora, model_config.dtype)
        self._mas_base: dict[str, torch.Tensor] = {}
        for f, names in self._mas_checkpoint_files():
            self._mas_base.update((name, f.get_tensor(name)) for name in names)
        if lora.adapter is not None:
            self._mas_reload(saved_adapters(lora.adapter))

    def mas_load_weights(self, version: int) -> str:
        receiver = getattr(self, "_mas_receiver", None)
        if receiver is None:
            raise RuntimeError("mas_load_weights before mas_join_weight_group")
        lora = getattr(self, "_mas_lora", None)
        try:
            got, tensors = receiver.receive(self._mas_lora_manifest if lora else self._mas_manifest())
        except ManifestMismatch as e:
            return str(e)
        except WeightSyncError as e:  # retired, or broken by a lost peer: the group is re-formed
            return RETIRED + str(e)
        if got != version:
            return f"the broadcast carried version {got}, the trainer announced {version}"
        self._mas_reload(tensors)
        return ""

    def _mas_reload(self, tensors: list[tuple[str, Any]]) -> None:
        """Load the received tensors: the model's own, or adapters merged into the kept base weights."""
        weights: Iterator[tuple[str, Any]] = iter(tensors)
        if getattr(self, "_mas_lora", None) is not None:
            from mas_async.lora import merge_adapters

            dtype = self.vllm_config.model_config.dtype  # type: ignore[attr-defined]
            merged = merge_adapters(self._mas_base, tensors, self._mas_lora.scale, dtype)
            # One base weight in the engine's dtype at a time (a generator): no second copy of the model.
            weights = ((name, merged.get(name, weight.to(dtype))) for name, weight in self._mas_base.items())
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)  # type: ignore[attr-defined]
        self._mas_refresh_tied_lm_head()

    def _mas_checkpoint_files(self) -> Iterator[tuple[Any, list[str]]]:
        """Each safetensors file of the model folder, open, with the names of its tensors (a tied lm_head
        not: it is the embedding)."""
        model_config = self.vllm_config.model_config  # type: ignore[attr-defined]
        tied = getattr(model_config.hf_text_config, "tie_word_embeddings", False)
        for path in sorted(Path(model_config.model).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                yield f, [name for name in f.keys() if not (tied and name == "lm_head.weight")]  # noqa: SIM118

    def _mas_manifest(self) -> list[tuple[str, list[int], str]]:
        """What the trainer sends: the checkpoint's tensors (a tied lm_head once, as the embedding),
        in the engine's dtype. Read from the safetensors headers of the model folder."""
        model_config = self.vllm_config.model_config  # type: ignore[attr-defined]
        dtype = dtype_name(model_config.dtype)
        return [
            (name, list(f.get_slice(name).get_shape()), dtype)
            for f, names in self._mas_checkpoint_files()
            for name in names
        ]

    def _mas_refresh_tied_lm_head(self) -> None:
        from vllm.config import set_current_vllm_config

        config = self.vllm_config  # type: ignore[attr-defined]
        if not getattr(config.model_config.hf_text_config, "tie_word_embeddings", False):
            return
        lm_head = getattr(self.model_runner.get_model(), "lm_head", None)  # type: ignore[attr-defined]
        method = getattr(lm_head, "quant_method", None)
        if method is not None:
            with set_current_vllm_config(config):
                method.process_weights_after_loading(lm_head)
