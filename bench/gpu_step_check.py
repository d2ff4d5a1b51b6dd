"""The first lent GPU's check of a real-sized training step (issue 57): memory, precision, weight sync, a stall.

    python bench/gpu_step_check.py            # on a GPU machine: Qwen3-1.7B's shape; ~4-6 min on one H100
    python bench/gpu_step_check.py --smoke    # the CPU rehearsal: a tiny shape of the same model; run by the tests

On random weights in Qwen3-1.7B's shape (hidden 2,048, 28 layers, 16 query / 8 key-value heads of 128, MLP
6,144, vocabulary 151,936, tied embeddings), through the trainer's own `PolicyLearner` with the run
defaults (`policies.<p>.dtype: bfloat16` served and computed, float32 master and Adam state, micro-batches
by the token budget derived from the model, log-probs in chunks of the sequence):

1. step: one training step on `--groups` prompts of `--prompt-tokens` x `--k` completions of
   `--completion-tokens` (default 2 x 8 of 1,024 + 4,096 tokens: 16 samples, the paper's K), random rewards:
   seconds, tokens/s and the peak memory (`torch.cuda.max_memory_allocated`; on the CPU the process's peak
   resident growth), against the GPU's memory; beside it the memory plan's figure of the very same step (the
   learner and samples on fake tensors, `mas_async.launch.trainer_memory`: what `--dry-run` plans), checked on a
   GPU to be within 10% of the measured peak (on the CPU the RSS is not its measure: printed only).
2. precision: `trainer/<p>/changed_fraction` of one step at lr 1e-6, with the float32 master (must be >= 0.9)
   and without it (`master_dtype: bfloat16`, pure bf16: the silent no-op the master exists to prevent).
3. broadcast: the weights as the trainer sends them (the served bf16 copy) from rank 0 to a receiver in
   another process: over NCCL from cuda:0 to cuda:1 when the machine has 2 GPUs (seconds and GB/s); NCCL
   cannot join two ranks on one GPU, so with one GPU the same send goes over gloo and the line says so.
4. stall: a receiver joins, then never receives; the sender's next send must end in the code's
   `WeightSyncError` within its bound (`--stall-bound`), with the process alive (not torn down by NCCL's
   watchdog), on the backend of 3.

Every wait is bounded. Results go to `$OUT/gpu_step_check.json` (`OUT` defaults to a new temp folder;
`--json FILE` overrides); exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from mas_async.deployment import free_ports
from mas_async.machine_paths import without_machine_paths

ROOT = Path(__file__).resolve().parents[1]

CONFIG = ROOT / "configs" / "plan_path_tiny.yaml"
POLICY = "vertical"
QWEN3_1P7B = {
    "hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 6144, "vocab_size": 151936, "tie_word_embeddings": True,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0,
}  # fmt: skip
TINY = {**QWEN3_1P7B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 128, "vocab_size": 4096}  # fmt: skip
CHANGED_AT_LEAST = 0.9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="the CPU rehearsal: a tiny shape, short samples, gloo")
    p.add_argument("--groups", type=int, default=2, help="prompts of the step (default 2)")
    p.add_argument("--k", type=int, default=8, help="completions per prompt (default 8)")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--completion-tokens", type=int, default=4096)
    p.add_argument("--stall-bound", type=float, default=20.0, help="the weight-sync bound of the stall check (s)")
    p.add_argument("--timeout", type=float, default=600.0, help="bound of every other wait (s)")
    p.add_argument("--json", type=Path, help="where to write the results (default $OUT/gpu_step_check.json)")
    args = p.parse_args(argv)
    if args.smoke:
        args.groups, args.k, args.prompt_tokens, args.completion_tokens, args.stall_bound = 2, 4, 48, 96, 5.0
    return args


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_model(shape: dict[str, Any], folder: Path, device: str) -> Path:
    """A model folder of random weights in `shape` (Qwen3 architecture), saved in bfloat16 as a hub model is."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**shape, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    return folder


def make_samples(args: argparse.Namespace, vocab: int, seed: int = 0) -> list[Any]:
    """`--groups` groups of `--k` samples: random prompts and completions, random rewards (non-zero advantages)."""
    import numpy as np

    from mas_async.wire.samples import Sample

    rng = np.random.default_rng(seed)
    samples = []
    for g in range(args.groups):
        prompt = rng.integers(0, vocab, args.prompt_tokens, dtype=np.int32)
        for _ in range(args.k):
            completion = rng.integers(0, vocab, args.completion_tokens, dtype=np.int32)
            samples.append(
                Sample(
                    group=f"e{g}/a/0",
                    episode_id=f"e{g}",
                    problem_id=f"p{g}",
                    agent="a",
                    policy=POLICY,
                    turn=0,
                    prompt_ids=prompt,
                    completion_ids=completion,
                    logprobs=np.full(args.completion_tokens, -1.0, dtype=np.float32),
                    version=0,
                    reward=float(rng.random()),
                )  # fmt: skip
            )
    return samples


def learner_for(path: Path, device: str, *, lr: float, master: str) -> Any:
    from mas_async.training.learner import PolicyLearner

    return PolicyLearner(config_for(path, device, lr=lr, master=master), POLICY, str(path))


def plan_figure(args: argparse.Namespace, path: Path, vocab: int) -> int:
    """The memory plan's peak of `check_step`'s step: the same config, model shape and samples, one step of a
    fresh learner on fake tensors (no GPU, no byte allocated), as `torch.cuda.max_memory_allocated` counts."""
    from mas_async.launch.trainer_memory import trainer_peak

    config = config_for(path, "cpu", lr=1e-6, master="float32")
    model_config = json.loads((path / "config.json").read_text())
    # Two of the step's samples: at the defaults each micro-batch holds one 5,120-token sample (the budget is
    # 1,872 tokens), so more samples add only their kept log-probs (KBs) and the fake step's minutes.
    samples = make_samples(args, vocab)[:2]
    return trainer_peak(config, POLICY, model_config, samples=samples, warm=False).peak


def config_for(path: Path, device: str, *, lr: float, master: str) -> Any:
    from mas_async.config import load_config

    overrides = [
        f"policies.{POLICY}.model={path}", f"policies.{POLICY}.dtype=bfloat16", f"policies.{POLICY}.master_dtype={master}",
        f"policies.{POLICY}.device={device}", f"policies.{POLICY}.lr={lr}", "run.iterations=2",
    ]  # fmt: skip
    return load_config(CONFIG, overrides)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_step(args: argparse.Namespace, path: Path, device: str, vocab: int) -> tuple[dict, dict[str, bool]]:
    """1: one step with the defaults on the real-sized samples."""
    import torch

    planned = plan_figure(args, path, vocab)
    learner = learner_for(path, device, lr=1e-6, master="float32")
    samples = make_samples(args, vocab)
    on_gpu = learner.device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize(learner.device)
        torch.cuda.reset_peak_memory_stats(learner.device)
        before = torch.cuda.memory_allocated(learner.device)
    else:
        before = peak_rss_bytes()
    start = time.perf_counter()
    metrics = learner.step(samples)
    _sync(learner.device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(learner.device) if on_gpu else peak_rss_bytes()
    total = torch.cuda.get_device_properties(learner.device).total_memory if on_gpu else None
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    figures = {
        "samples": len(samples), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "peak_bytes": peak, "held_before_bytes": before, "device_bytes": total,
        "micro_batches": metrics.get("micro_batches"), "changed_fraction": metrics.get("trainer/changed_fraction"),
        "plan_peak_bytes": planned,
    }  # fmt: skip
    print(
        f"[step] {len(samples)} samples, {tokens} tokens in {seconds:.1f}s = {tokens / seconds:.0f} tokens/s, "
        f"{metrics.get('micro_batches')} micro-batches; peak {peak / 2**30:.1f} GiB"
        + (f" of the GPU's {total / 2**30:.1f} GiB" if total else " (process peak RSS)")
    )
    print(
        f"[plan] the memory plan's figure of this step {planned / 2**30:.2f} GiB beside "
        + (
            f"max_memory_allocated {peak / 2**30:.2f} GiB ({planned / peak:.3f})"
            if on_gpu
            else "(no GPU: not compared)"
        )
    )
    fits = total is None or peak < total
    del learner
    checks = {"[step] the step ran within the device's memory": fits}
    if on_gpu:
        torch.cuda.empty_cache()
        checks["[plan] the memory plan's figure within 10% of max_memory_allocated"] = abs(planned - peak) <= 0.1 * peak
    return figures, checks


def check_precision(args: argparse.Namespace, path: Path, device: str, vocab: int) -> tuple[dict, dict[str, bool]]:
    """2: changed_fraction at lr 1e-6, float32 master on and off."""
    import torch

    short = argparse.Namespace(**{**vars(args), "groups": 1, "k": 4, "prompt_tokens": 64, "completion_tokens": 64})
    figures = {}
    for master in ("float32", "bfloat16"):
        learner = learner_for(path, device, lr=1e-6, master=master)
        figures[master] = learner.step(make_samples(short, vocab, seed=1)).get("trainer/changed_fraction")
        del learner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(
        f"[precision] changed_fraction at lr 1e-6: float32 master {figures['float32']:.4f}, "
        f"pure bf16 {figures['bfloat16']:.4f}"
    )
    return figures, {
        f"[precision] with the float32 master a step at lr 1e-6 changes >= {CHANGED_AT_LEAST} of the weights":
        (figures["float32"] or 0.0) >= CHANGED_AT_LEAST,
        "[precision] pure bf16 changes fewer (the metric sees the no-op)": (figures["bfloat16"] or 0.0)
        < (figures["float32"] or 0.0),
    }  # fmt: skip


def _receiver(backend: str, port: int, bound: float, join_s: float, stall: bool, device: str, out: Any) -> None:
    """Rank 1 in a process of its own: receive one send (or, `stall`, join and never receive)."""
    try:
        import torch

        from mas_async.weights.group import open_weight_group
        from mas_async.weights.receiver import WeightReceiver

        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        group = open_weight_group(
            policy="check",
            backend=backend,
            host="127.0.0.1",
            port=port,
            rank=1,
            world_size=2,
            timeout_s=bound,
            join_timeout_s=join_s,
        )
        out.put(("joined", None))
        if stall:
            time.sleep(4 * bound + 60)  # never receives; the parent ends this process
            return
        version, tensors = WeightReceiver(group).receive()
        _sync(tensors[0][1].device)
        out.put(("received", version))
    except BaseException:  # re-raised in the parent, with its traceback
        out.put(("error", traceback.format_exc()))


def _expect(out: Any, kind: str, timeout: float) -> Any:
    got, value = out.get(timeout=timeout)
    if got == "error":
        raise RuntimeError(f"the receiver failed:\n{value}")
    if got != kind:
        raise RuntimeError(f"the receiver said {got!r}, expected {kind!r}")
    return value


def check_broadcast(args: argparse.Namespace, path: Path, device: str, gpus: int) -> tuple[dict, dict[str, bool]]:
    """3 and 4: the weights' send to another process, then a send that the receiver never takes."""
    import torch

    from mas_async.weights.group import WeightSyncError, open_weight_group
    from mas_async.weights.sender import WeightSender

    backend, why = ("nccl", "cuda:0 -> cuda:1") if gpus >= 2 else ("gloo", "NCCL cannot join two ranks on one GPU")
    learner = learner_for(path, device, lr=1e-6, master="float32")
    named = learner.named_tensors()
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    ctx = mp.get_context("spawn")
    figures: dict[str, Any] = {"backend": backend, "why": why, "bytes": nbytes}
    checks: dict[str, bool] = {}
    for stall in (False, True):
        bound = args.stall_bound if stall else args.timeout
        port, out = free_ports("127.0.0.1", 1)[0], ctx.Queue()
        receiver_device = "cuda:1" if backend == "nccl" else "cpu"
        child = ctx.Process(
            target=_receiver, args=(backend, port, bound, args.timeout, stall, receiver_device, out), daemon=True
        )
        child.start()
        try:
            group = open_weight_group(
                policy="check",
                backend=backend,
                host="127.0.0.1",
                port=port,
                rank=0,
                world_size=2,
                timeout_s=bound,
                join_timeout_s=args.timeout,
            )
            _expect(out, "joined", args.timeout)
            sender = WeightSender(group)
            start = time.perf_counter()
            if not stall:
                sender.send(1, named)
                _expect(out, "received", args.timeout)
                seconds = time.perf_counter() - start
                figures.update(seconds=seconds, gb_per_s=nbytes / seconds / 1e9)
                print(f"[broadcast] {nbytes / 2**30:.2f} GiB over {backend} ({why}) in {seconds:.2f}s = "
                      f"{nbytes / seconds / 1e9:.1f} GB/s")  # fmt: skip
                checks[f"[broadcast] the receiver got version 1 over {backend}"] = True
                continue
            try:
                sender.send(1, named)
                error = None
            except WeightSyncError as e:
                error = str(e)
            waited = time.perf_counter() - start
            figures["stall"] = {"error": error, "seconds": waited, "bound_s": bound}
            print(f"[stall] after {waited:.1f}s (bound {bound:g}s): {error or 'NO ERROR'}")
            checks[f"[stall] a stalled {backend} send ends in WeightSyncError, the process alive"] = error is not None
            checks["[stall] within its bound and the library's margin"] = waited < 2 * bound + 60
        finally:
            child.kill()
            child.join(30)
    del learner
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return figures, checks


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not args.smoke and gpus == 0:
        print("gpu_step_check: no GPU here; run --smoke for the CPU rehearsal", file=sys.stderr)
        return 2
    shape = TINY if args.smoke else QWEN3_1P7B
    device = "cuda:0" if gpus and not args.smoke else "cpu"
    out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-step-check-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"shape": shape, "device": device, "gpus": gpus, "args": vars(args)}
    checks: dict[str, bool] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-step-model-") as tmp:
        start = time.perf_counter()
        path = make_model(shape, Path(tmp) / "model", "cuda:0" if device != "cpu" else "cpu")
        result["model_s"] = time.perf_counter() - start
        print(f"model: random weights in {'a tiny' if args.smoke else 'Qwen3-1.7B'}'s shape, {result['model_s']:.0f}s")
        for name, run in (
            ("step", lambda: check_step(args, path, device, shape["vocab_size"])),
            ("precision", lambda: check_precision(args, path, device, shape["vocab_size"])),
            ("broadcast", lambda: check_broadcast(args, path, device, gpus)),
        ):
            try:
                result[name], passed = run()
            except Exception:
                result[name] = {"error": traceback.format_exc()}
                passed = {f"[{name}] ran": False}
                print(result[name]["error"], file=sys.stderr)
            checks.update(passed)
    result["checks"] = checks
    path_json = args.json or out_dir / "gpu_step_check.json"
    path_json.write_text(json.dumps(without_machine_paths(result), indent=1, default=str))
    for check, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {check}")
    print(f"wrote {path_json}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The stall check leaves a retired group whose gloo/NCCL work never completes; its library thread can
    # abort the interpreter's teardown ("terminate called"), so the status is given without one.
    os._exit(code)
