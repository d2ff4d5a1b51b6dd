"""One trainer rank's peak memory at the real model shape, measured without a GPU and without allocating a byte.

The project's own training step (`PolicyLearner(config, policy, path, dp=...)`, `learner.step(samples, version)`)
runs on a model built from the policy's config.json with no weights (transformers' `from_config` inside
torch's `FakeTensorMode`: every tensor has a shape, a dtype and a device, no storage), on a batch at the
config's token budget (`trainer.max_tokens_per_micro_batch` or the model's, `micro_batches.token_budget`)
of sequences of `prompt_tokens` + `rollout.max_tokens` (with bounded staleness k, the k + 1 kept copies of the
weights held too), under `torch.distributed._tools.mem_tracker.MemTracker`,
which adds up the bytes of every storage alive after each op: the figure `torch.cuda.max_memory_allocated`
reports on a GPU (on real CPU tensors it measures the same allocated bytes; tests/unit/framework/
test_memory_plan.py checks the fake figure against a real CPU step of a 100M-parameter model). Two steps run:
the first creates the Adam state, the second's peak is the steady one, reported.

Rank r of N is played by one process through torch's "fake" process group (every collective returns at once),
with the learner's seams: `_load_model` builds the weightless model, `_data_parallel` is replaced by a stand-in
of DDP's memory (its gradient buckets: one more copy of the gradients, as `gradient_as_bucket_view` is off;
DDP cannot run on fake tensors), and the group's small sums are answered locally. Two things outside the
learner are adjusted while the step runs, and restored: a dispatch mode answers every read of a tensor's value
(`.item()`, `float(t)`: a fake has none) with 1, and transformers' `is_tracing` no longer takes a fake tensor
for a traced one (else each layer would build an explicit mask and copies of K and V that a real step does not).

Planned on the CPU device: the step's tensors are those of a GPU step (autocast's casts follow CPU autocast's
op lists, which cast the matrix products as CUDA's do). Not counted: the CUDA context, cuBLAS and NCCL
workspaces, the allocator's fragmentation (`memory_plan.MARGIN_BYTES`, `MARGIN_FRACTION`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mas_async.training.data_parallel import DataParallel
from mas_async.training.learner import PolicyLearner
from mas_async.training.micro_batches import token_budget
from mas_async.wire.samples import Sample

if TYPE_CHECKING:
    from mas_async.config import Config

DEFAULT_PROMPT_TOKENS = 1024
"""Prompt tokens of each planned sequence where the dry run is not told (`--prompt-tokens`)."""


@dataclass(frozen=True)
class TrainerPeak:
    """What one planned rank's two steps measured, in bytes."""

    peak: int
    """The second step's peak (the steady one): every tensor alive at once, at the worst op."""
    first_step: int
    """The first step's peak, on 2 one-token sequences: it creates the Adam state, which a steady step holds
    from its start, so the steady peak bounds it."""
    before_step: int
    """What the learner holds between steps (weights, gradients' buckets, Adam state, served copy)."""
    samples: int
    """Sequences of the planned step (each `prompt_tokens` + `rollout.max_tokens` long)."""
    micro_batch_tokens: int
    """The token budget of a micro-batch that the step was cut by."""


def plan_samples(config: Config, policy: str, model_config: Any, prompt_tokens: int) -> tuple[list[Sample], int]:
    """The planned step's batch: as many sequences of `prompt_tokens` + `rollout.max_tokens` as one micro-batch
    holds (at least 2: a group of one has no advantage and trains nothing), in one group with rewards 0 and 1
    alternating, so every sample goes through backward; and the micro-batch token budget."""
    trainer = config.trainer
    budget = trainer.max_tokens_per_micro_batch or token_budget(model_config, trainer.activation_checkpointing)
    completion = config.rollout.max_tokens
    length = prompt_tokens + completion
    count = max(2, min(trainer.micro_batch_sequences, budget // length))
    vocab = model_config.get_text_config().vocab_size
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, prompt_tokens).astype(np.int32)
    samples = [
        Sample(
            group="plan/agent/0", episode_id="plan", problem_id="plan", agent="agent", policy=policy, turn=0,
            prompt_ids=prompt, completion_ids=rng.integers(0, vocab, completion).astype(np.int32),
            logprobs=np.full(completion, -1.0, dtype=np.float32), version=0, reward=float(i % 2),
        )
        for i in range(count)
    ]  # fmt: skip
    return samples, budget


def trainer_peak(
    config: Config,
    policy: str,
    model_config: dict,
    rank: int = 0,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    samples: list[Sample] | None = None,
    warm: bool = True,
    fake: bool = True,
) -> TrainerPeak:
    """Rank `rank` of `policy`'s trainer ranks: its memory over two planned steps (module docstring), on the
    fake tensors of a weightless model of `model_config` (a config.json dict). `samples`: the step's batch
    instead of the planned one; `warm` False: one step of a fresh learner (what a first step on a GPU measures),
    its peak reported as `peak`. `fake` False: the same on real CPU tensors of random weights (the check of the
    plan: MemTracker then counts the bytes really allocated)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoConfig

    plan_config = _on_cpu(config, policy)
    world = config.policies[policy].trainer_ranks
    folder = Path(tempfile.mkdtemp(prefix="mas-async-plan-"))
    (folder / "config.json").write_text(json.dumps(model_config))
    auto = AutoConfig.from_pretrained(str(folder))
    planned, budget = plan_samples(config, policy, auto, prompt_tokens)
    samples = samples if samples is not None else planned
    dp = None
    if world > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        dp = _PlanGroup(policy, rank, world, "fake", config.trainer.group_timeout_s)
    tracker = _PeakTracker()
    try:
        faking = (FakeTensorMode(allow_non_fake_inputs=True), _fake_not_traced()) if fake else ()
        scalars = _Scalars if fake else contextlib.nullcontext
        with contextlib.ExitStack() as stack:
            for context in faking:
                stack.enter_context(context)
            if fake:  # (flat_params reads a fake's data pointer, the optimiser calls deprecated names: warnings)
                stack.enter_context(warnings.catch_warnings())
                warnings.simplefilter("ignore")
            with tracker, scalars():
                learner = _PlannedLearner(plan_config, policy, str(folder), dp=dp, model_config=auto)
                for version in range(-config.rollout.max_staleness, 1):  # bounded staleness's kept weights
                    if config.rollout.max_staleness:
                        learner.keep_weights(version)
                # The first step creates the Adam state, which a steady step holds throughout: a short one.
                learner.step(_short(samples) if warm else samples, 0)
            first = peak = _peak(tracker)
            held = _current(tracker)
            if warm:
                with tracker, scalars():
                    learner.step(samples, 0)
                peak = _peak(tracker)
            del learner
    finally:
        if dp is not None:
            dist.destroy_process_group()
        shutil.rmtree(folder, ignore_errors=True)
    return TrainerPeak(peak, first, held, len(samples), budget)


def _short(samples: list[Sample]) -> list[Sample]:
    """Two one-token sequences of the planned group (rewards 0 and 1): a step that trains at the least cost."""
    import dataclasses

    return [
        dataclasses.replace(
            s, prompt_ids=s.prompt_ids[:1], completion_ids=s.completion_ids[:1], logprobs=s.logprobs[:1]
        )
        for s in samples[:2]
    ]


class _PlannedLearner(PolicyLearner):
    """The learner on a weightless model of a config (`_load_model`), with DDP's memory stood in for
    (`_data_parallel`) and no loss scaler (its overflow check would read a value a fake tensor has not)."""

    def __init__(self, config: Config, policy: str, model_path: str, *, dp: DataParallel | None, model_config: Any):
        self._model_config = model_config
        super().__init__(config, policy, model_path, dp=dp)
        self.scaler = None

    def _load_model(self, model_path: str, dtype: torch.dtype) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(self._model_config, dtype=dtype)

    def _data_parallel(self) -> torch.nn.Module:
        return _DdpMemory(self.model)


class _DdpMemory(torch.nn.Module):
    """DistributedDataParallel's memory without its reducer: the model's forward, `no_sync`, and the gradient
    buckets DDP holds for as long as it lives (one copy of every gradient, in the parameters' dtype, as
    `gradient_as_bucket_view` is off)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        trained = [p for p in module.parameters() if p.requires_grad]
        self.buckets = {
            dtype: torch.empty(sum(p.numel() for p in trained if p.dtype == dtype), dtype=dtype)
            for dtype in {p.dtype for p in trained}
        }

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield


class _PlanGroup(DataParallel):
    """The policy's group as seen by one planned rank: every rank is alike, so a sum over the ranks is N
    times this rank's (only the loss normaliser and the counts read it: no memory depends on it)."""

    def sum(self, values: list[float], device: torch.device) -> list[float]:
        return [v * self.world_size for v in values]

    def gather(self, obj: Any) -> list[Any]:
        return [obj] * self.world_size


class _Scalars(TorchDispatchMode):
    """Answers every read of a tensor's value (`aten._local_scalar_dense`: `.item()`, `float(t)`, `int(t)`)
    with 1: a fake tensor has no value. Nothing of a planned step's memory depends on one (a norm, a count,
    Adam's step number)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            return True if dtype == torch.bool else 1.0 if dtype.is_floating_point else 1
        return func(*args, **(kwargs or {}))


class _NoModules:
    """MemTracker's module tracker, left out: the plan wants the global peak only (its per-module walk is
    most of the time, and it refuses the LM head run outside the model's forward, once per log-prob chunk)."""

    is_bw = False
    parents: frozenset[str] = frozenset()

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> _NoModules:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


def _tracker_class() -> type:
    from torch.distributed._tools.mem_tracker import MemTracker

    class PeakTracker(MemTracker):
        """MemTracker with the global peak only (`_NoModules`). Entering it again starts a new peak from what
        is alive then; what it saw before stays tracked."""

        def __init__(self) -> None:
            super().__init__()
            self._mod_tracker = _NoModules()

    return PeakTracker


def _PeakTracker() -> Any:  # noqa: N802
    return _tracker_class()()


def _peak(tracker: Any) -> int:
    return sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())


def _current(tracker: Any) -> int:
    return sum(snap["Total"] for snap in tracker.get_tracker_snapshot("current").values())


@contextlib.contextmanager
def _fake_not_traced() -> Iterator[None]:
    """transformers takes a fake tensor for a traced one (`is_tracing`) and builds masks a real step does not;
    within this block its masking code asks only whether something is really tracing."""
    from transformers import masking_utils
    from transformers.utils.import_utils import is_tracing

    masking_utils.is_tracing = lambda tensor=None: is_tracing()
    try:
        yield
    finally:
        masking_utils.is_tracing = is_tracing


def _on_cpu(config: Config, policy: str) -> Config:
    """`config` with `policy`'s trainer on the CPU device (fakes need no GPU; the step is the same)."""
    plan = config.model_copy(deep=True)
    spec = plan.policies[policy]
    spec.device = "cpu"
    spec.trainer_devices = None
    return plan
