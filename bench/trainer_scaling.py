"""Trainer scale-out on this machine: samples/s and memory per rank of one policy's training step with 1
rank, 2 ranks (DistributedDataParallel over gloo), 2 ranks with ZeRO (`trainer.zero`) and 1 rank training
LoRA adapters (`policies.<p>.lora`), on the same batch; ratios against 1 rank measured in the same run,
median and range over repeats (interleaved). Then the weight sync of the full model against the LoRA
adapters only: bytes and seconds per version, trainer to one hf inference backend over gloo.

    python bench/trainer_scaling.py                    # tiny model, 64 samples, 4 timed steps, 3 repeats
    python bench/trainer_scaling.py --samples 128 --steps 8 --repeats 5
    python bench/trainer_scaling.py --smoke            # 1 rank and LoRA, 1 step, 1 repeat: the plumbing only
                                                       # (its 2 ranks and ZeRO: bench/gpu_check.py --smoke)

Each setting runs in fresh processes (torch.multiprocessing), each rank with cores / ranks torch threads,
so 2 ranks use the same cores as 1. A rank trains on its share of the batch (whole groups of 4, dealt
in turn); one untimed step warms up, then `--steps` steps are timed between two barriers. Memory per
rank: the optimiser state it holds (`optimizer_state_bytes`, which ZeRO shards) and its peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

from mas_async import preloaded_processes

ROOT = Path(__file__).resolve().parents[1]

CONFIG = "configs/plan_path_tiny.yaml"
SETTINGS = {"1 rank": (1, False, False), "2 ranks": (2, False, False), "2 ranks + ZeRO": (2, True, False),
            "1 rank + LoRA": (1, False, True)}  # fmt: skip
"""name: (ranks, ZeRO, LoRA)."""
SMOKE_SETTINGS = ("1 rank", "1 rank + LoRA")
"""--smoke's: `measure` with 2 ranks and with ZeRO runs in `bench/gpu_check.py --smoke`, which the tests run too."""
LORA = "{r: 8, alpha: 16}"
"""`policies.vertical.lora` of the LoRA setting: rank 8 on every linear layer."""
GROUP = 4


def _batch(count: int, seed: int) -> list[Any]:
    """`count` samples in groups of 4 with varied lengths and rewards (log-probs are not checked here)."""
    from mas_async.wire.samples import Sample

    rng = np.random.default_rng(seed)
    samples = []
    for i in range(count):
        prompt = rng.integers(1, 30, size=int(rng.integers(24, 48))).astype(np.int32)
        completion = rng.integers(1, 30, size=int(rng.integers(8, 24))).astype(np.int32)
        group = i // GROUP
        samples.append(
            Sample(f"e{group}/vertical/0", f"e{group}", "p", "vertical", "vertical", 0, prompt, completion,
                   np.zeros(len(completion), np.float32), 0, float(rng.normal()))
        )  # fmt: skip
    return samples


def _share(samples: list[Any], rank: int, world: int) -> list[Any]:
    groups = [samples[i : i + GROUP] for i in range(0, len(samples), GROUP)]
    return [s for g in groups[rank::world] for s in g]


def _learner(model: str, lora: bool, dp: Any = None, zero: bool = False, world: int = 1, gpus: bool = False) -> Any:
    """The policy's learner of this rank; `gpus`: rank r on cuda:r (`policies.<p>.trainer_devices`)."""
    from mas_async.config import load_config
    from mas_async.training.learner import PolicyLearner

    overrides = [f"trainer.zero={str(zero).lower()}", "algorithm.ppo_epochs=1", "algorithm.mini_batches=1",
                 f"policies.vertical.trainer_ranks={world}"]  # fmt: skip
    if gpus:
        overrides.append(f"policies.vertical.trainer_devices=[{', '.join(f'cuda:{r}' for r in range(world))}]")
    config = load_config(ROOT / CONFIG, overrides + ([f"policies.vertical.lora={LORA}"] if lora else []))
    torch.manual_seed(0)
    return PolicyLearner(config, "vertical", model, dp=dp)


def _rank(
    rank: int, world: int, zero: bool, lora: bool, port: int, model: str, count: int, steps: int, gpus: bool, out: dict
) -> None:
    from mas_async.devices import use_device
    from mas_async.training.data_parallel import DataParallel

    device = f"cuda:{rank}" if gpus else "cpu"
    use_device(device, f"rank {rank}")
    if not gpus:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dp = None
    if world > 1:
        dp = DataParallel.join(
            policy="vertical", device=device, host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=120
        )
    try:
        learner = _learner(model, lora, dp, zero, world, gpus)
        share = _share(_batch(count, seed=0), rank, world)
        learner.step(share, 0)  # warm-up
        if dp is not None:
            dp.sum([0.0], learner.device)  # barrier
        began = time.perf_counter()
        for _ in range(steps):
            metrics = learner.step(share, 0)
        if dp is not None:
            dp.sum([0.0], learner.device)
        out[rank] = {
            "seconds": time.perf_counter() - began,
            "optimizer_state_mb": metrics["optimizer_state_bytes"] / 2**20,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_gpu_mb": torch.cuda.max_memory_allocated(device) / 2**20 if gpus else 0.0,
            "parameter_norms": [float(p.detach().double().norm()) for _, p in learner.trained],
        }
    finally:
        if dp is not None:
            dp.close()


def _sync_rank(rank: int, lora: bool, port: int, model: str, versions: int, out: dict) -> None:
    """Rank 0: a trainer's learner sends `versions` versions; rank 1: an hf backend receives and loads them."""
    from mas_async.config import load_config
    from mas_async.inference.backends.base import ThreadedBackend
    from mas_async.inference.backends.hf import HFBackend
    from mas_async.lora import LoraSetup
    from mas_async.weights.sync import open_sender

    torch.set_num_threads(1)
    group = {"policy": "vertical", "backend": "gloo", "host": "127.0.0.1", "port": port, "world_size": 2}
    if rank == 1:
        spec = load_config(ROOT / CONFIG, [f"policies.vertical.lora={LORA}"]).policies["vertical"].lora
        server = ThreadedBackend(HFBackend(model, lora=LoraSetup.of(spec, model) if lora else None))
        server.join_weight_group(rank=1, **group)
        for version in range(1, versions + 1):
            server.update_weights(version)
        return
    learner = _learner(model, lora)
    sender = open_sender(**group)
    seconds = []
    for version in range(1, versions + 1):
        began = time.perf_counter()
        stats = sender.send(version, learner.named_tensors())
        seconds.append(time.perf_counter() - began)
    out.update({"bytes": stats["bytes"], "fraction": stats["bytes"] / learner.full_bytes(), "seconds": seconds[1:]})


def measure_sync(model: str, lora: bool, versions: int) -> dict[str, Any]:
    """Bytes, share of the full model and seconds of each version's send (the first, which also sends
    the manifest, left out)."""
    out = mp.Manager().dict()
    preloaded_processes.spawn(_sync_rank, (lora, _free_port(), model, versions + 1, out), nprocs=2)
    return dict(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_bounded(fn: Any, args: tuple, nprocs: int, timeout_s: float, what: str) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)`, waited for at most `timeout_s`: past it the processes
    are killed and TimeoutError names `what`; a process that fails raises as in spawn."""
    context = preloaded_processes.spawn(fn, args, nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):  # True once every process has ended
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{what} did not finish within {timeout_s:g} s")


def measure(
    world: int, zero: bool, lora: bool, model: str, count: int, steps: int, gpus: bool = False, timeout_s: float = 900
) -> dict[str, Any]:
    """One setting in fresh processes (`gpus`: rank r on cuda:r, NCCL): samples/s over the timed steps, the
    per-rank maxima of memory, and rank 0's parameter norms after the steps (equal settings make equal
    updates). Processes still running after `timeout_s` are killed and raise TimeoutError."""
    out = mp.Manager().dict()
    spawn_bounded(_rank, (world, zero, lora, _free_port(), model, count, steps, gpus, out), world, timeout_s,
                  f"{world} rank(s) (ZeRO {zero}, LoRA {lora})")  # fmt: skip
    ranks = [out[r] for r in range(world)]
    seconds = max(r["seconds"] for r in ranks)
    return {
        "samples_per_s": count * steps / seconds,
        "optimizer_state_mb": max(r["optimizer_state_mb"] for r in ranks),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        "peak_gpu_mb": max(r["peak_gpu_mb"] for r in ranks),
        "parameter_norms": ranks[0]["parameter_norms"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-char", help="a model source (mas_async.model_source)")
    parser.add_argument("--samples", type=int, default=64, help="samples per step (a multiple of 8)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--syncs", type=int, default=20, help="timed weight syncs, full and LoRA")
    parser.add_argument("--sync-only", action="store_true", help="only the weight syncs (e.g. for a larger --model)")
    parser.add_argument("--smoke", action="store_true", help="1 rank and LoRA, 1 step, 1 repeat, 16 samples")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.smoke:
        args.samples, args.steps, args.repeats, args.syncs = 16, 1, 1, 2
    if args.samples % (2 * GROUP):
        raise SystemExit(f"--samples must be a multiple of {2 * GROUP} (whole groups of {GROUP} for each of 2 ranks)")

    from mas_async.launch.launcher import model_cache_dir
    from mas_async.machine_paths import without_machine_paths
    from mas_async.model_source import resolve_model

    model = str(resolve_model(args.model, model_cache_dir()))
    settings = {} if args.sync_only else SETTINGS
    settings = {name: settings[name] for name in SMOKE_SETTINGS if name in settings} if args.smoke else settings
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in settings}
    for repeat in range(args.repeats if settings else 0):
        for name, (world, zero, lora) in settings.items():
            runs[name].append(measure(world, zero, lora, model, args.samples, args.steps))
            print(
                f"repeat {repeat + 1}/{args.repeats}, {name}: {runs[name][-1]['samples_per_s']:.1f} samples/s",
                flush=True,
            )

    figures: dict[str, Any] = {"model": args.model, "samples": args.samples, "steps": args.steps, "settings": {}}
    print(f"\n{args.model}, {args.samples} samples a step, {args.steps} timed steps, {args.repeats} repeats, "
          f"{os.cpu_count()} cores\n")  # fmt: skip
    if runs:
        print_steps(runs, figures)
    print(
        "\n| weight sync, one hf server, gloo | bytes per version | of the full model | seconds per version, median (range) |"
    )
    print("|---|---|---|---|")
    for name, lora in (("full model", False), (f"LoRA {LORA}", True)):
        sync = measure_sync(model, lora, args.syncs)
        figures.setdefault("sync", {})[name] = sync
        seconds = sync["seconds"]
        print(f"| {name} | {sync['bytes']:.0f} | {sync['fraction']:.3f} | "
              f"{statistics.median(seconds) * 1e3:.2f} ms ({min(seconds) * 1e3:.2f}-{max(seconds) * 1e3:.2f}) |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(without_machine_paths(figures), indent=2))


def print_steps(runs: dict[str, list[dict[str, float]]], figures: dict[str, Any]) -> None:
    """The table of the training-step settings, with ratios against 1 rank (also into `figures`)."""
    base = runs["1 rank"]
    print(
        "| setting | samples/s, median (range) | vs 1 rank, median (range) | optimiser state per rank | peak RSS per rank |"
    )
    print("|---|---|---|---|---|")
    for name, measured in runs.items():
        rate = [m["samples_per_s"] for m in measured]
        ratio = [m["samples_per_s"] / b["samples_per_s"] for m, b in zip(measured, base, strict=True)]
        state = statistics.median(m["optimizer_state_mb"] for m in measured)
        rss = statistics.median(m["peak_rss_mb"] for m in measured)
        figures["settings"][name] = {"samples_per_s": rate, "vs_1_rank": ratio, "optimizer_state_mb": state,
                                     "peak_rss_mb": rss}  # fmt: skip
        print(f"| {name} | {statistics.median(rate):.1f} ({min(rate):.1f}-{max(rate):.1f}) | "
              f"{statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f}) | {state:.2f} MiB | {rss:.0f} MiB |")  # fmt: skip


if __name__ == "__main__":
    main()
