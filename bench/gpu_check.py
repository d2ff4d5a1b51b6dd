"""GPU check without vLLM: the hf backend and a trainer on one offline GPU, weight sync, log-prob match.

The one command for a lent GPU machine (docs/gpu.md gives it with the device kit's install):

    python bench/gpu_check.py            # one GPU: fp32 and bf16 passes of builtin:100m-char, then the
                                         # demo learning on cuda (CUDA IPC sync); ~4-6 minutes
    python bench/gpu_check.py --smoke    # the CPU rehearsal: builtin:tiny-char, fp32, gloo, ~1 minute

What it does, per dtype (float32, then bfloat16; --smoke: float32 on the CPU):
1. Materialises the built-in model (~104M parameters; --smoke: tiny-char) and builds the trainer's
   `PolicyLearner` and the server's `HFBackend` (behind `ThreadedBackend`) on the device.
2. Joins them in a gloo weight group (NCCL refuses two ranks on one GPU), in this process.
3. Rollout: `--prompts` prompts x n=`--n`, `--max-tokens` tokens each: tokens/s (after a warm-up).
4. A trainer step on those samples (random rewards): seconds and completion tokens/s.
5. The versioned update: the trainer's `WeightSender` sends v1, the server's `update_weights(1)` loads
   it; a second rollout must carry version 1 and its log-probs must match the trainer's recompute:
   mean |diff| < 1e-4 in fp32; < 5e-2 in bf16 (8 mantissa bits: the server's cached, incremental decode
   and the trainer's one full forward round differently at every layer). The step must have moved the
   log-probs by 10x more than that difference, or the match proves nothing.
6. Weight-sync time (median of `--rounds`) against a raw copy of the same bytes over the same path:
   device -> host copy, one gloo broadcast, host -> device copy, of one preallocated buffer.
7. CUDA IPC (GPU only; `mas_async.weights.cuda_ipc`): a server in a child process on the same GPU maps
   the trainer's shared buffer sets; per version the trainer copies its weights into the free set and
   announces it. Checks the version and the log-probs as in 5; times the send against a
   device-to-device copy of the same bytes. Skipped by --smoke, with a line saying so.
A second trainer step is timed too (the first one also allocates the optimiser state).
8. The LoRA pass ("float32+lora"): steps 1-6 with `policies.vertical.lora` (LORA): the trainer steps
   adapters only, the server applies them with peft, every sync carries the adapters only (their bytes
   and share of the full model are reported); the same version and log-prob checks.
9. The ranks pass: one policy's training step with 1 rank, 2 ranks (DistributedDataParallel) and 2 ranks
   with ZeRO, rank r on cuda:r over NCCL (`bench/trainer_scaling.py`, `--rank-samples` x `--rank-steps`):
   samples/s against 1 rank, optimiser state and peak GPU memory per rank; checks that both 2-rank
   settings end on 1 rank's parameters and that ZeRO shards the state. Needs 2 GPUs (a line says it is
   skipped on one); --smoke runs it on the CPU over gloo. With 2 GPUs the demo below trains its vertical
   policy with 2 trainer ranks.
10. Once, after the passes: the demo learning through `mas-async train` (every role its own process):
   configs/plan_path_tiny_gpu.yaml, both policies on cuda, weight sync chosen by
   `cluster.weight_backend: auto` (CUDA IPC: each trainer shares its GPU with its server; the backends and
   every process's GPU by UUID are read back from the run's deployment.json, where the launcher recorded
   them: `mas_async.placement`),
   `--demo-iterations` iterations capped at `--demo-timeout` s. Wall time, seconds per iteration, eval
   success, the weight-sync time; checks that it exited 0, that each trainer logged the backend auto
   chose, every version_mismatch 0 and every logprob_abs_diff < 1e-4. --smoke: configs/plan_path_tiny.yaml
   on the CPU (gloo), 2 small iterations. `--demo-iterations 0` skips it.

vLLM is detected first and never imported here: its checks are bench/gpu_check_vllm.py. Every wait is
bounded (`--timeout`, 60 s), an error in a helper thread is re-raised in the main one, and the results go
to `$OUT/gpu_check.json` (`OUT` defaults to a new temp folder; `--json FILE` overrides). Exit status 0
when every check passes.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import queue
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's mas_async, also where none is installed (the GPU machine)

# Mean |server - trainer| log-prob after an update, per dtype (see the module docstring for why).
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
# The versions this project was run with; others may work: a mismatch warns, never fails.
TESTED = {"torch": ("2.11", "2.13"), "transformers": ("5.17", "5.19")}
CONFIG = ROOT / "configs" / "plan_path_tiny.yaml"
DEMO = {"cuda": ROOT / "configs" / "plan_path_tiny_gpu.yaml", "cpu": CONFIG}
DEMO_SMOKE = ["rollout.batch_size=4", "algorithm.k=4", "eval.every=1", "eval.size=4"]
POLICY = "vertical"
LORA = "{r: 16, alpha: 32}"
"""`policies.vertical.lora` of the LoRA pass."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU rehearsal: tiny-char, fp32, gloo, a small workload")
    p.add_argument("--model", default="builtin:100m-char", help="a built-in preset or a local model folder")
    p.add_argument(
        "--dtypes", default="float32,bfloat16,float32+lora", help="comma-separated passes (dtype, +lora: LoRA adapters)"
    )
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4, help="samples per prompt (one request with n)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5, help="timed weight syncs per path")
    p.add_argument("--lr", type=float, default=1e-3, help="the trainer step's Adam learning rate")
    p.add_argument("--timeout", type=float, default=60.0, help="bound of every wait, in seconds")
    p.add_argument("--json", type=Path, default=None, help="results file (default $OUT/gpu_check.json)")
    p.add_argument(
        "--rank-samples", type=int, default=64, help="samples per step of the ranks pass (whole groups of 4)"
    )
    p.add_argument("--rank-steps", type=int, default=4, help="timed steps per setting of the ranks pass (0: skip it)")
    p.add_argument("--demo-iterations", type=int, default=30, help="iterations of the demo run (0: skip it)")
    p.add_argument("--demo-timeout", type=float, default=180.0, help="bound of the demo run, in seconds")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.dtypes = "builtin:tiny-char", "float32,float32+lora"
        args.prompts, args.n, args.max_tokens, args.rounds = 4, 2, 8, 2
        args.demo_iterations = min(args.demo_iterations, 2)
        args.rank_samples, args.rank_steps = 16, min(args.rank_steps, 1)
    return args


def _minor(version: str) -> tuple[int, int]:
    major, minor, *_ = (version.split("+")[0] + ".0").split(".")
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def environment() -> dict[str, Any]:
    """Versions and device; warns (never fails) when a package is outside the tested range."""
    import torch
    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda": torch.version.cuda, "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }  # fmt: skip
    if env["gpus"]:
        env["gpu"] = torch.cuda.get_device_name(0)
    for name, (low, high) in TESTED.items():
        if not _minor(low) <= _minor(env[name]) <= _minor(high):
            print(f"warning: {name} {env[name]} is outside the tested {low}..{high}; carrying on")
    return env


class Worker:
    """A function in a daemon thread whose result (or exception, re-raised) is collected with a bound."""

    def __init__(self, name: str, fn: Callable[[], Any]) -> None:
        self.name, self._box = name, {}
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._box["result"] = fn()
        except BaseException as e:  # handed to the owner, which re-raises it
            self._box["error"] = e

    def result(self, timeout: float) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.name}: not done within {timeout:g} s")
        if "error" in self._box:
            raise self._box["error"]
        return self._box.get("result")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_prompts(count: int, seed: int = 0) -> list[Any]:
    import numpy as np

    rng = np.random.default_rng(seed)  # ids 7..50: the character tokens of the built-in vocabulary
    return [rng.integers(7, 51, size=int(rng.integers(24, 64))).astype(np.int32) for _ in range(count)]


def generate(backend: Any, prompts: list[Any], n: int, max_tokens: int, timeout: float) -> tuple[list, float]:
    """(completions per prompt, seconds) of one batched generate call."""
    from mas_async.inference.request import GenerationRequest

    requests = [GenerationRequest(p, n=n, max_tokens=max_tokens, temperature=1.0) for p in prompts]
    start = time.perf_counter()
    results = Worker("generate", lambda: asyncio.run(backend.generate(requests))).result(timeout)
    return results, time.perf_counter() - start


def logprob_diff(model: Any, prompts: list[Any], results: list[list[Any]]) -> tuple[float, float]:
    """Mean and max |server - trainer| log-prob over every sampled token."""
    import numpy as np
    import torch

    from mas_async.training.logprobs import completion_logprobs

    pairs = [(p, c) for p, group in zip(prompts, results, strict=True) for c in group]
    diffs = []
    with torch.no_grad():
        for start in range(0, len(pairs), 64):
            chunk = pairs[start : start + 64]
            ours = completion_logprobs(model, [p for p, _ in chunk], [c.token_ids for _, c in chunk], 1.0)
            diffs += [np.abs(o.float().cpu().numpy() - c.logprobs) for o, (_, c) in zip(ours, chunk, strict=True)]
    flat = np.concatenate(diffs)
    return float(flat.mean()), float(flat.max())


def make_samples(prompts: list[Any], results: list[list[Any]], seed: int) -> list[Any]:
    """One group per prompt (its n completions) with random rewards, so every advantage is non-zero."""
    import numpy as np

    from mas_async.wire.samples import Sample

    rng = np.random.default_rng(seed)
    return [
        Sample(
            group=f"e{i}/a/0",
            episode_id=f"e{i}",
            problem_id=f"p{i}",
            agent="a",
            policy=POLICY,
            turn=0,
            prompt_ids=prompt,
            completion_ids=c.token_ids,
            logprobs=c.logprobs,
            version=c.version,
            reward=float(rng.random()),
        )  # fmt: skip
        for i, (prompt, group) in enumerate(zip(prompts, results, strict=True))
        for c in group
    ]


def train_step(learner: Any, samples: list[Any]) -> dict[str, float]:
    start = time.perf_counter()
    stats = learner.step(samples)
    _sync(learner.device)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": stats["tokens"], "tokens_per_s": stats["tokens"] / seconds}


def run_dtype(args: argparse.Namespace, name: str, device: str, folder: Path) -> tuple[dict, dict[str, bool]]:
    """One pass (steps 1-7 of the module docstring) in dtype `name`, or with "+lora" after it the LoRA
    pass (step 9: steps 1-6 with adapters); returns (figures, checks)."""
    import torch

    from mas_async.config import load_config
    from mas_async.inference.backends.base import ThreadedBackend
    from mas_async.inference.backends.hf import HFBackend
    from mas_async.lora import LoraSetup
    from mas_async.tiny_model import materialise
    from mas_async.training.learner import PolicyLearner
    from mas_async.weights.group import open_weight_group
    from mas_async.weights.sender import WeightSender

    dtype, _, variant = name.partition("+")
    lora = variant == "lora"
    t0 = time.perf_counter()
    path = materialise(args.model, folder) if args.model.startswith("builtin:") else Path(args.model)
    overrides = [
        f"policies.{POLICY}.model={path}", f"policies.{POLICY}.dtype={dtype}", f"policies.{POLICY}.device={device}",
        f"policies.{POLICY}.lr={args.lr}", "trainer.micro_batch_sequences=64", "run.iterations=2",
        *([f"policies.{POLICY}.lora={LORA}"] if lora else []),
    ]  # fmt: skip
    config = load_config(CONFIG, overrides)
    learner = PolicyLearner(config, POLICY, str(path))
    setup = LoraSetup.of(config.policies[POLICY].lora, str(path)) if lora else None
    backend = ThreadedBackend(HFBackend(path, dtype=dtype, device=device, max_batch_sequences=1024, seed=0, lora=setup))
    named = learner.named_tensors()
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    figures: dict[str, Any] = {
        "model": args.model, "dtype": dtype, "lora": LORA if lora else None, "device": device,
        "parameters": sum(t.numel() for _, t in named), "bytes": nbytes, "of_full_model": nbytes / learner.full_bytes(),
        "setup_s": time.perf_counter() - t0,
    }  # fmt: skip
    checks: dict[str, bool] = {}
    sent = f" (LoRA {LORA}: {figures['of_full_model']:.3f} of the model)" if lora else ""
    print(f"[{name}] {args.model}: {figures['parameters'] / 1e6:.1f}M parameters sent{sent}, {nbytes / 2**20:.1f} MiB, "
          f"trainer and hf server on {device}, ready in {figures['setup_s']:.1f}s")  # fmt: skip

    # 2. The weight group: gloo through host memory (NCCL refuses two ranks on one GPU).
    port = _free_port()
    opener = Worker("open weight group (rank 0)", lambda: open_weight_group(
        policy="check", backend="gloo", host="127.0.0.1", port=port, rank=0, world_size=2, timeout_s=args.timeout
    ))  # fmt: skip
    backend.join_weight_group(policy="check", backend="gloo", host="127.0.0.1", port=port, rank=1, world_size=2)
    group = opener.result(args.timeout)
    sender = WeightSender(group)

    # 3. Rollout throughput (after a warm-up batch: kernels, allocator, cuBLAS handles).
    prompts = make_prompts(args.prompts)
    generate(backend, prompts[:2], 1, 4, args.timeout)
    results, seconds = generate(backend, prompts, args.n, args.max_tokens, args.timeout)
    tokens = sum(len(c.token_ids) for g in results for c in g)
    figures["rollout"] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    print(f"[{name}] rollout v0: {tokens} tokens in {seconds:.2f}s = {tokens / seconds:.0f} tokens/s "
          f"({args.prompts} prompts x n={args.n}, {args.max_tokens} tokens)")  # fmt: skip

    # 4. A trainer step on those samples.
    figures["train_step_first"] = train_step(learner, make_samples(prompts, results, seed=1))
    before = logprob_diff(learner.model, prompts, results)[0]  # how far the step moved the v0 samples

    # 5. The versioned update into the server, then the log-prob match.
    def push(version: int) -> float:
        start = time.perf_counter()
        sending = Worker(f"send v{version}", lambda: sender.send(version, learner.named_tensors()))
        backend.update_weights(version)
        sending.result(args.timeout)
        _sync(backend.engine.device)
        return time.perf_counter() - start

    figures["update_v1_s"] = push(1)
    results, seconds = generate(backend, prompts, args.n, args.max_tokens, args.timeout)
    mean, worst = logprob_diff(learner.model, prompts, results)
    figures["rollout_v1"] = {"tokens": sum(len(c.token_ids) for g in results for c in g), "seconds": seconds}
    figures["logprob"] = {"mean_abs_diff": mean, "max_abs_diff": worst, "step_moved": before,
                          "tolerance": TOLERANCE[dtype]}  # fmt: skip
    checks[f"[{name}] gloo: every output carries version 1"] = all(c.version == 1 for g in results for c in g)
    checks[f"[{name}] gloo: mean |server - trainer| log-prob < {TOLERANCE[dtype]:g}"] = mean < TOLERANCE[dtype]
    checks[f"[{name}] the step moved the log-probs 10x more than that"] = before > 10 * mean
    print(f"[{name}] after the step and the update to v1: mean |server - trainer| log-prob {mean:.2e} "
          f"(max {worst:.2e}); the step itself moved them by {before:.2e}")  # fmt: skip

    # 6. Weight sync against the raw path of the same bytes (interleaved, median).
    flat = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    landing = torch.empty_like(flat)

    def raw() -> float:
        start = time.perf_counter()
        host_out, host_in = flat.cpu(), torch.empty(nbytes, dtype=torch.uint8)
        sending = Worker("raw broadcast", lambda: group.broadcast(host_out))
        backend.receiver.group.broadcast(host_in)
        sending.result(args.timeout)
        landing.copy_(host_in)
        _sync(landing.device)
        return time.perf_counter() - start

    pairs = [(push(2 + i), raw()) for i in range(args.rounds)]
    sync_s, raw_s = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    figures["gloo_sync"] = {"versioned_s": sync_s, "raw_s": raw_s, "ratio": sync_s / raw_s, "rounds": args.rounds}
    print(f"[{name}] weight sync over gloo (median of {args.rounds}): versioned {sync_s * 1e3:.1f} ms, raw "
          f"(D2H copy, broadcast, H2D copy) {raw_s * 1e3:.1f} ms: ratio {sync_s / raw_s:.2f}")  # fmt: skip
    group.close()

    # The second trainer step: optimiser state already allocated.
    figures["train_step"] = train_step(learner, make_samples(prompts, results, seed=2))
    step = figures["train_step"]
    print(f"[{name}] trainer step: {step['seconds']:.2f}s for {len(prompts) * args.n} samples "
          f"= {step['tokens_per_s']:.0f} completion tokens/s (first step {figures['train_step_first']['seconds']:.2f}s)")  # fmt: skip

    # 7. CUDA IPC into a server process on the same GPU.
    if lora:
        print(f"[{name}] CUDA IPC: not checked with LoRA adapters")
    elif device == "cpu":
        print(f"[{name}] CUDA IPC: skipped on the CPU (--smoke); its protocol's CPU tests: tests/unit/framework/test_cuda_ipc.py")  # fmt: skip
    else:
        ipc, ipc_checks = run_cuda_ipc(args, dtype, path, learner, prompts)
        figures["cuda_ipc"] = ipc
        checks.update(ipc_checks)
    return figures, checks


def _ipc_server(port: int, path: str, dtype: str, prompts: list[Any], args: dict[str, Any], out: Any) -> None:
    """The child process: an hf server on the same GPU that takes its weights through CUDA IPC."""
    from mas_async.inference.backends.base import ThreadedBackend
    from mas_async.inference.backends.hf import HFBackend

    try:
        backend = ThreadedBackend(HFBackend(path, dtype=dtype, device="cuda", max_batch_sequences=1024, seed=1))
        backend.join_weight_group(policy="check", backend="cuda_ipc", host="127.0.0.1", port=port, rank=1, world_size=2)
        out.put(("joined", None))
        for version in range(1, 2 + args["rounds"]):
            start = time.perf_counter()
            backend.update_weights(version)
            out.put(("loaded", (version, time.perf_counter() - start)))
            if version == 1:
                results, _ = generate(backend, prompts, args["n"], args["max_tokens"], args["timeout"])
                out.put(("results", [[(c.token_ids, c.logprobs, c.version) for c in g] for g in results]))
    except BaseException:
        out.put(("error", traceback.format_exc()))
        raise


def run_cuda_ipc(args: argparse.Namespace, dtype: str, path: Path, learner: Any, prompts: list[Any]) -> tuple:
    """Step 7: (figures, checks) of the CUDA IPC path against a device-to-device copy of the same bytes."""
    import numpy as np
    import torch

    from mas_async.weights.sync import open_sender
    from mas_async.wire.samples import Completion

    port, ctx = _free_port(), mp.get_context("spawn")
    out = ctx.Queue()
    options = {"rounds": args.rounds, "n": args.n, "max_tokens": args.max_tokens, "timeout": args.timeout}
    child = ctx.Process(target=_ipc_server, args=(port, str(path), dtype, prompts, options, out), daemon=True)
    child.start()

    def expect(kind: str) -> Any:
        try:
            got, value = out.get(timeout=args.timeout)
        except queue.Empty:
            raise TimeoutError(f"CUDA IPC server: no {kind!r} within {args.timeout:g} s") from None
        if got == "error":
            raise RuntimeError(f"CUDA IPC server failed:\n{value}")
        if got != kind:
            raise RuntimeError(f"CUDA IPC server said {got!r}, expected {kind!r}")
        return value

    checks: dict[str, bool] = {}
    try:
        sender = open_sender(
            policy="check", backend="cuda_ipc", host="127.0.0.1", port=port, world_size=2, timeout_s=args.timeout
        )
        expect("joined")
        sends, round_trips = [], []
        for version in range(1, 2 + args.rounds):
            start = time.perf_counter()
            sends.append(sender.send(version, learner.named_tensors())["seconds"])
            loaded, server_s = expect("loaded")
            round_trips.append(time.perf_counter() - start)
            assert loaded == version, (loaded, version)
            if version == 1:
                results = [
                    [Completion(token_ids=ids, logprobs=lp, version=v, finish_reason="length") for ids, lp, v in g]
                    for g in expect("results")
                ]
                mean, worst = logprob_diff(learner.model, prompts, results)
                checks[f"[{dtype}] CUDA IPC: every output carries version 1"] = all(
                    c.version == 1 for g in results for c in g
                )
                checks[f"[{dtype}] CUDA IPC: mean |server - trainer| log-prob < {TOLERANCE[dtype]:g}"] = (
                    mean < TOLERANCE[dtype]
                )
        child.join(args.timeout)
        checks[f"[{dtype}] CUDA IPC: the server process exited cleanly"] = child.exitcode == 0
        sender.close()
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)

    # The raw baseline: a device-to-device copy of the same bytes, synchronised like the send.
    nbytes = sum(t.numel() * t.element_size() for _, t in learner.named_tensors())
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copies = []
    for _ in range(args.rounds + 1):
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - start)
    send_s, raw_s = statistics.median(sends[1:]), statistics.median(copies[1:])  # the first ones warm up
    figures = {
        "send_s": send_s, "raw_copy_s": raw_s, "ratio": send_s / raw_s, "first_send_s": sends[0],
        "round_trip_s": float(np.median(round_trips[1:])), "logprob_mean_abs_diff": mean, "logprob_max_abs_diff": worst,
    }  # fmt: skip
    print(f"[{dtype}] CUDA IPC into a server process on the same GPU: mean |server - trainer| log-prob {mean:.2e} "
          f"(max {worst:.2e}); send {send_s * 1e3:.2f} ms (copy into the free set, sync, announce) against a "
          f"device copy of the same bytes {raw_s * 1e3:.2f} ms: ratio {send_s / raw_s:.2f}; round trip to "
          f"the server's adoption {figures['round_trip_s'] * 1e3:.1f} ms")  # fmt: skip
    return figures, checks


RANK_SETTINGS = {"1 rank": (1, False), "2 ranks": (2, False), "2 ranks + ZeRO": (2, True)}
"""name: (trainer ranks, ZeRO) of the ranks pass."""
NORMS_TOLERANCE = {"cpu": 1e-6, "cuda": 1e-4}
"""Most relative difference of a parameter's norm after the steps, 2 ranks against 1 (on GPUs the reductions'
order differs)."""


def run_ranks(args: argparse.Namespace, device: str, gpus: int) -> tuple[dict, dict[str, bool]]:
    """Step 9: one policy's training step with 1 rank, 2 ranks (DistributedDataParallel) and 2 ranks with
    ZeRO, rank r on cuda:r (NCCL; --smoke: the CPU, gloo) through `bench/trainer_scaling.py`: samples/s,
    memory per rank, and the parameters after the steps equal to 1 rank's. Needs 2 GPUs; (figures, checks)."""
    from bench.trainer_scaling import measure
    from mas_async.launch.launcher import model_cache_dir
    from mas_async.model_source import resolve_model

    if device == "cuda" and gpus < 2:
        print(f"[ranks] skipped: 2 trainer ranks need 2 GPUs, this machine has {gpus}")
        return {"skipped": f"needs 2 GPUs, this machine has {gpus}"}, {}
    model = str(resolve_model(args.model, model_cache_dir()))
    rows = {}
    for name, (world, zero) in RANK_SETTINGS.items():
        rows[name] = measure(world, zero, False, model, args.rank_samples, args.rank_steps, gpus=device == "cuda",
                             timeout_s=args.timeout * 10)  # fmt: skip
        memory = (
            f"{rows[name]['peak_gpu_mb']:.0f} MiB GPU"
            if device == "cuda"
            else f"{rows[name]['peak_rss_mb']:.0f} MiB RSS"
        )
        print(f"[ranks] {name}: {rows[name]['samples_per_s']:.1f} samples/s "
              f"({rows[name]['samples_per_s'] / rows['1 rank']['samples_per_s']:.2f}x 1 rank), optimiser state "
              f"{rows[name]['optimizer_state_mb']:.1f} MiB per rank, peak {memory} per rank")  # fmt: skip
    one = rows["1 rank"]["parameter_norms"]
    drift = {
        name: max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(row["parameter_norms"], one, strict=True))
        for name, row in rows.items()
    }
    tolerance = NORMS_TOLERANCE[device]
    checks = {
        f"[ranks] {name}: 1 rank's update (parameter norms within {tolerance:g}, relative)": drift[name] < tolerance
        for name in ("2 ranks", "2 ranks + ZeRO")
    }
    zero, full = rows["2 ranks + ZeRO"]["optimizer_state_mb"], rows["2 ranks"]["optimizer_state_mb"]
    checks["[ranks] ZeRO holds at most 0.6 of the optimiser state per rank"] = zero <= 0.6 * full
    for name, row in rows.items():
        row.pop("parameter_norms")
        row["vs_1_rank"] = row["samples_per_s"] / rows["1 rank"]["samples_per_s"]
        row["parameter_norm_drift"] = drift[name]
    return {"device": device, "samples": args.rank_samples, "steps": args.rank_steps, "settings": rows}, checks


def demo_agreement(trained: list[dict[str, Any]], policies: list[str]) -> tuple[int | None, float | None]:
    """The demo's worst `version_mismatch` and `logprob_abs_diff` over its trained rows and `policies`; None (not
    measured: the check fails) where a row in which a policy trained samples lacks one of them for it, or a policy
    trained none in any row."""
    worst: list[Any] = []
    for name in ("version_mismatch", "logprob_abs_diff"):
        stepped = [(r, f"policy/{p}/{name}") for p in policies for r in trained if r.get(f"policy/{p}/samples")]
        every = bool(policies) and all(any(r.get(f"policy/{p}/samples") for r in trained) for p in policies)
        measured = every and all(key in r for r, key in stepped)
        worst.append(max(r[key] for r, key in stepped) if measured else None)
    return worst[0], worst[1]


def run_demo(args: argparse.Namespace, device: str, run_dir: Path, ranks: int = 1) -> tuple[dict, dict[str, bool]]:
    """Step 10: the demo config learning on `device` through `mas-async train`, the vertical policy with
    `ranks` trainer ranks (one GPU each); (figures, checks)."""
    config = DEMO[device]
    overrides = [f"run.iterations={args.demo_iterations}", f"run.output_dir={run_dir}"]
    overrides += DEMO_SMOKE if args.smoke else []
    overrides += [f"policies.{POLICY}.trainer_ranks={ranks}"] if ranks > 1 else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "mas_async", "train", str(config), *overrides]
    print(f"demo: {config.relative_to(ROOT)}, {args.demo_iterations} iterations on {device} "
          f"(at most {args.demo_timeout:g} s)")  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=args.demo_timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        output, timed_out = "", True
    finally:
        _kill_run(proc, run_dir)
    wall_s = time.perf_counter() - start
    # What the launcher decided from where the processes are (`mas_async.placement`), as the run recorded it.
    placed = run_dir / "deployment.json"
    deployment = json.loads(placed.read_text()) if placed.exists() else {"nodes": {}, "weight_backends": {}}
    backends, places = deployment.get("weight_backends", {}), deployment["nodes"]
    print(f"demo: weight sync {backends}; GPUs " + ", ".join(
        f"{name} {place.get('gpu') or place.get('device')}" for name, place in places.items() if place.get("gpu")
    ))  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    trained = [r for r in rows if "time/train_s" in r]
    evals = [r["eval/team_success_rate"] for r in rows if "eval/team_success_rate" in r]
    mismatch, diff = demo_agreement(trained, list(backends))
    logs = {p: run_dir / "logs" / f"trainer-{p}.log" for p in backends}
    chosen = {p: f"({b})" in (logs[p].read_text() if logs[p].exists() else "") for p, b in backends.items()}
    elapsed = [r["time/elapsed_s"] for r in trained if "time/elapsed_s" in r]
    figures = {
        "config": str(config.relative_to(ROOT)), "device": device, "weight_backends": backends, "places": places,
        "iterations": len(trained), "wall_s": wall_s, "returncode": proc.returncode, "timed_out": timed_out,
        "s_per_iteration": (elapsed[-1] - elapsed[0]) / (len(elapsed) - 1) if len(elapsed) > 1 else None,
        "weight_sync_s_mean": statistics.mean(r["time/weight_sync_s"] for r in trained) if trained else None,
        "eval_success": evals, "version_mismatch_max": mismatch, "logprob_abs_diff_max": diff,
    }  # fmt: skip
    checks = {
        f"demo on {device}: ran its {args.demo_iterations} iterations and exited 0": (
            not timed_out and proc.returncode == 0 and len(trained) == args.demo_iterations
        ),
        f"demo on {device}: every trainer synced over the backend the deployment chose "
        f"{sorted(set(backends.values()))}": bool(backends) and all(chosen.values()),
        f"demo on {device}: every version_mismatch 0 and logprob_abs_diff < 1e-4 (measured each iteration)": (
            mismatch == 0 and diff is not None and diff < 1e-4
        ),
    }
    if not checks[f"demo on {device}: ran its {args.demo_iterations} iterations and exited 0"]:
        print("demo output (tail):\n" + "\n".join(output.splitlines()[-20:]))
    per_iteration = figures["s_per_iteration"]
    print(f"demo: {len(trained)} iterations in {wall_s:.1f}s wall"
          + (f" ({per_iteration:.2f} s/iteration after the first)" if per_iteration else "")
          + (f", weight sync {sync:.4f} s mean" if (sync := figures["weight_sync_s_mean"]) is not None else "")
          + f", eval success {evals}, version_mismatch max {'not measured' if mismatch is None else mismatch}, "
          f"logprob_abs_diff max {'not measured' if diff is None else f'{diff:.1e}'}")  # fmt: skip
    return figures, checks


def _kill_run(proc: subprocess.Popen, run_dir: Path) -> None:
    """Kill the launcher and every process it recorded, by pid (a finished run has none left)."""
    pids_file = run_dir / "pids.json"
    pids = list(json.loads(pids_file.read_text()).values()) if pids_file.exists() else []
    for pid in [proc.pid, *pids]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vllm = importlib.util.find_spec("vllm")
    print("vLLM: " + ("installed; its checks are bench/gpu_check_vllm.py (not run here)" if vllm else
                      "absent; running the checks that need no vLLM (hf backend, trainer, gloo and CUDA IPC sync)"))  # fmt: skip
    env = environment()
    if args.smoke:
        device = "cpu"
    elif env["gpus"]:
        device = "cuda"
    else:
        print("no CUDA GPU: this check needs one (--smoke rehearses it on the CPU)")
        return 2
    print(f"python {env['python']}, torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}; "
          f"device {device}{' (' + env['gpu'] + ')' if device == 'cuda' else ''}")  # fmt: skip
    out_file = args.json or Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="mas-gpu-check-")) / "gpu_check.json"
    report: dict[str, Any] = {"env": env, "vllm": "present" if vllm else "absent", "device": device, "passes": {}}
    checks: dict[str, bool] = {}
    errors: dict[str, str] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mas-gpu-models-") as tmp:
        for name in args.dtypes.split(","):
            try:
                report["passes"][name], found = run_dtype(args, name, device, Path(tmp))
                checks.update(found)
            except Exception:  # one pass failing must not cost the other's figures: recorded, then fails the run
                errors[name] = traceback.format_exc()
                print(f"[{name}] FAILED:\n{errors[name]}")
                checks[f"[{name}] the pass ran to its end"] = False
            if device == "cuda":
                import torch

                torch.cuda.empty_cache()
        if args.rank_steps > 0:
            try:
                report["ranks"], found = run_ranks(args, device, env["gpus"])
                checks.update(found)
            except Exception:
                errors["ranks"] = traceback.format_exc()
                print(f"[ranks] FAILED:\n{errors['ranks']}")
                checks["[ranks] the pass ran to its end"] = False
        if args.demo_iterations > 0:
            ranks = 2 if device == "cuda" and env["gpus"] >= 2 else 1
            try:
                report["demo"], found = run_demo(args, device, Path(tmp) / "demo", ranks)
                checks.update(found)
            except Exception:
                errors["demo"] = traceback.format_exc()
                print(f"demo FAILED:\n{errors['demo']}")
                checks["the demo run ran to its end"] = False
    report.update(checks=checks, errors=errors, seconds=time.perf_counter() - started)
    report["passed"] = bool(checks) and all(checks.values())
    from mas_async.machine_paths import without_machine_paths

    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(without_machine_paths(report), indent=2, default=str) + "\n")
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    print(f"{'passed' if report['passed'] else 'FAILED'} in {report['seconds']:.0f}s; results: {out_file}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
