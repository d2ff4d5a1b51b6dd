"""Rollout throughput of the framework against the standalone engine on the same prompts.

1. Framework: a rollout-only deployment (`bench.support`: the real router, env workers and
   inference servers as separate processes, no trainers) runs `--warmup` + `--iterations` rollout
   phases of Plan-Path training episodes (tree sampling, K candidates per agent per turn) with one
   policy. It records every phase's window, every generate request and every inference batch.
2. Standalone: the same engine (`make_backend`, same model, dtype, seed, batching limit) in this
   process, with no framework around it, generates exactly the prompts the framework's episodes sent,
   with the same sampling settings, in lockstep: the j-th request of every episode of a phase go to the
   engine as one batch (the most a framework could batch, given that an episode's next prompt depends
   on its last answer). Only the engine's generate calls are timed.

It prints rollout tokens/s, episodes/s, env steps/s (one per candidate: each steps its own env clone),
generation latency p50/p99 (request to reply, seen by the env worker), the inference servers' busy
fraction and the overhead ratio = framework tokens/s / standalone tokens/s (target >= 0.90).

    python bench/rollout_throughput.py --backend mock --mock-step-ms 10    # a ~1.7B model on a GPU
    python bench/rollout_throughput.py --backend hf --model builtin:small-char
    python bench/rollout_throughput.py --smoke                             # seconds; run by the tests
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench.support import BENCH_DIR, run_rollout
from mas_async.config import Config, load_config
from mas_async.wire.codec import unpack

ROOT = Path(__file__).resolve().parents[1]

CONFIG = ROOT / "configs" / "plan_path_tiny_shared.yaml"
POLICY = "shared"


def build_config(args: argparse.Namespace, run_dir: Path) -> Config:
    overrides = [
        f"run.output_dir={run_dir}",
        f"run.iterations={args.iterations}",
        "eval.every=0",
        f"policies.{POLICY}.backend={args.backend}",
        f"policies.{POLICY}.model={args.model}",
        f"policies.{POLICY}.max_batch_sequences={args.max_batch}",
        f"rollout.batch_size={args.episodes}",
        f"rollout.max_tokens={args.max_tokens}",
        f"algorithm.k={args.k}",
        f"workflow.options.max_turns={args.max_turns}",
        f"cluster.env_workers={args.env_workers}",
        f"cluster.torch_threads={args.torch_threads}",
        *args.set,
    ]
    return load_config(CONFIG, overrides)


# -- the framework ---------------------------------------------------------------------------------


def run_framework(config: Config, warmup: int, timeout_s: float) -> dict[str, Any]:
    """Run the rollout-only deployment to the end; return what its processes recorded."""
    run_dir, deployment = run_rollout(config, warmup=warmup, timeout_s=timeout_s)
    out = run_dir / BENCH_DIR
    requests = []
    for path in sorted(out.glob("requests-*.msgpack")):
        requests += unpack(path.read_bytes())
    batches = {path.stem: json.loads(path.read_text()) for path in sorted(out.glob("batches-*.json"))}
    phases = json.loads((out / "phases.json").read_text())["phases"]
    return {"phases": phases, "requests": requests, "batches": batches, "model_path": deployment.model_paths[POLICY]}


def framework_figures(record: dict[str, Any]) -> dict[str, Any]:
    phases = [p for p in record["phases"] if not p["warmup"]]
    measured = {p["iteration"] for p in phases}
    wall = sum(p["end"] - p["start"] for p in phases)
    requests = [r for r in record["requests"] if _iteration(r[0]) in measured]
    latencies = np.array([r[6] - r[5] for r in requests]) * 1000
    busy = []
    for batches in record["batches"].values():
        # The union of the batch intervals: a continuous-batching engine (vLLM) runs several at once.
        seconds = sum(_overlap(start, end, p["start"], p["end"]) for start, end in _union(batches) for p in phases)
        busy.append(seconds / wall)
    return {
        "seconds": wall,
        "tokens": float(sum(p["tokens"] for p in phases)),
        "tokens_per_s": sum(p["tokens"] for p in phases) / wall,
        "phase_tokens_per_s": [p["tokens"] / (p["end"] - p["start"]) for p in phases],
        "episodes_per_s": sum(p["episodes"] for p in phases) / wall,
        "env_steps_per_s": sum(r[3] for r in requests) / wall,
        "latency_p50_ms": float(np.percentile(latencies, 50)),
        "latency_p99_ms": float(np.percentile(latencies, 99)),
        "busy_fraction": float(np.mean(busy)),
        "dropped": float(sum(p["dropped"] for p in phases)),
    }


def _iteration(episode_id: str) -> int:
    """'train3-12' -> 3."""
    return int(episode_id.removeprefix("train").split("-")[0])


def _union(batches: list[list[float]]) -> list[tuple[float, float]]:
    """Disjoint (start, end) intervals covering the (start, end, sequences) batches."""
    merged: list[tuple[float, float]] = []
    for start, end, _ in sorted(batches):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


# -- the standalone engine -------------------------------------------------------------------------


def lockstep_waves(requests: list[list[Any]], iteration: int) -> list[list[list[Any]]]:
    """The requests of one phase as batches: the j-th request of every episode form batch j."""
    by_episode: dict[str, list[list[Any]]] = defaultdict(list)
    for request in requests:
        if _iteration(request[0]) == iteration:
            by_episode[request[0]].append(request)
    ordered = [sorted(rs, key=lambda r: r[5]) for rs in by_episode.values()]
    depth = max((len(rs) for rs in ordered), default=0)
    return [[rs[j] for rs in ordered if j < len(rs)] for j in range(depth)]


def run_standalone(config: Config, record: dict[str, Any]) -> dict[str, Any]:
    """Replay the framework's prompts on the bare engine, phase by phase, in lockstep batches."""
    import torch

    from mas_async.inference.backends.base import make_backend
    from mas_async.inference.request import GenerationRequest
    from mas_async.rollout.env_worker import load_tokenizer, stop_token_ids

    torch.set_num_threads(config.cluster.torch_threads)
    spec, rollout = config.policies[POLICY], config.rollout
    model_path = record["model_path"]
    backend = make_backend(
        spec.backend,
        model_path,
        dtype=spec.dtype,
        max_batch_sequences=spec.max_batch_sequences,
        seed=config.run.seed * 1000,
    )
    stops = stop_token_ids(load_tokenizer(model_path))

    def request(r: list[Any]) -> GenerationRequest:
        return GenerationRequest(
            prompt_ids=np.asarray(r[2]),
            n=r[3],
            max_tokens=rollout.max_tokens,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            greedy=r[4],
            stop_token_ids=stops,
        )

    async def replay() -> dict[str, Any]:
        per_phase: list[tuple[float, float]] = []  # (seconds, tokens) of each measured phase
        for phase in record["phases"]:
            seconds = tokens = 0.0
            for wave in lockstep_waves(record["requests"], phase["iteration"]):
                batch = [request(r) for r in wave]
                start = time.perf_counter()
                results = await backend.generate(batch)
                seconds += time.perf_counter() - start
                tokens += sum(len(c.token_ids) for group in results for c in group)
            if not phase["warmup"]:
                per_phase.append((seconds, tokens))
        seconds, tokens = sum(s for s, _ in per_phase), sum(t for _, t in per_phase)
        return {
            "seconds": seconds,
            "tokens": tokens,
            "tokens_per_s": tokens / seconds,
            "phase_tokens_per_s": [t / s for s, t in per_phase],
        }

    return asyncio.run(replay())


# -- report ----------------------------------------------------------------------------------------


def report(args: argparse.Namespace, framework: dict[str, Any], standalone: dict[str, Any]) -> dict[str, Any]:
    # Medians over the phases: one phase slowed by another job on a shared machine does not decide it.
    ours, raw = float(np.median(framework["phase_tokens_per_s"])), float(np.median(standalone["phase_tokens_per_s"]))
    ratio = ours / raw
    speed = f", mock step {args.mock_step_ms} ms + {args.mock_token_ms} ms/seq" if args.backend == "mock" else ""
    print(
        f"rollout throughput: backend {args.backend}, model {args.model}{speed}; {args.episodes} episodes x "
        f"K={args.k}, max_tokens {args.max_tokens}, {args.env_workers} env worker(s), "
        f"{args.iterations} phases after {args.warmup} warm-up"
    )
    rows = [
        ("rollout tokens/s", framework["tokens_per_s"], standalone["tokens_per_s"], ".0f"),
        ("tokens", framework["tokens"], standalone["tokens"], ".0f"),
        ("seconds (phases / generate calls)", framework["seconds"], standalone["seconds"], ".3f"),
    ]
    for name, ours, raw, spec in rows:
        print(f"  {name:<36} framework {format(ours, spec):>10}   standalone {format(raw, spec):>10}")
    print(f"  {'episodes/s':<36} framework {framework['episodes_per_s']:>10.2f}")
    print(f"  {'env steps/s (candidates)':<36} framework {framework['env_steps_per_s']:>10.1f}")
    print(
        f"  {'generation latency p50 / p99 (ms)':<36} framework "
        f"{framework['latency_p50_ms']:>10.1f} / {framework['latency_p99_ms']:.1f}"
    )
    print(f"  {'inference busy fraction':<36} framework {framework['busy_fraction']:>10.2f}")
    if framework["dropped"]:
        print(f"  WARNING: {framework['dropped']:.0f} episodes were dropped")
    for name, figures in (("framework", framework), ("standalone", standalone)):
        phases = ", ".join(f"{x:.0f}" for x in figures["phase_tokens_per_s"])
        print(f"  {'tokens/s per phase':<36} {name:<10} {phases}")
    print(f"overhead ratio (median phase tokens/s, framework / standalone): {ratio:.3f}   (target >= 0.90)")
    return {
        "bench": "rollout_throughput",
        "date": datetime.now().isoformat(timespec="seconds"),
        "args": vars(args),
        "framework": framework,
        "standalone": standalone,
        "overhead_ratio": ratio,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["hf", "mock", "vllm"], default="mock")
    p.add_argument("--model", default=None, help="default: builtin:small-char (hf), builtin:tiny-char (mock)")
    p.add_argument("--episodes", type=int, default=16, help="episodes per phase (rollout.batch_size)")
    p.add_argument("--k", type=int, default=8, help="candidates per agent per turn")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=512, help="max_batch_sequences of engine (both runs)")
    p.add_argument("--iterations", type=int, default=3, help="measured rollout phases")
    p.add_argument("--warmup", type=int, default=1, help="rollout phases run first and not measured")
    p.add_argument("--env-workers", type=int, default=1)
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--mock-step-ms", type=float, default=10.0, help="mock: ms per decode step of a batch")
    p.add_argument("--mock-token-ms", type=float, default=0.0, help="mock: extra ms per sequence per step")
    p.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="more config overrides of the framework run, e.g. policies.shared.batch_gather_fraction=0",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the framework run may take")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    p.add_argument("--run-dir", type=Path, help="keep the framework's run directory here (default: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="a tiny run (seconds), for the tests")
    args = p.parse_args(argv)
    if args.smoke:
        args.backend, args.episodes, args.k, args.max_tokens, args.max_turns = "mock", 2, 2, 2, 2
        args.iterations, args.warmup, args.mock_step_ms, args.mock_token_ms, args.timeout = 1, 0, 1.0, 0.0, 120.0
    if args.model is None:
        args.model = "builtin:small-char" if args.backend == "hf" else "builtin:tiny-char"
    return args


def main(argv: list[str] | None = None) -> int:
    from mas_async.inference.backends.mock import MockSpeed

    args = parse_args(argv)
    speed = MockSpeed(args.mock_step_ms / 1000, args.mock_token_ms / 1000, args.max_batch)
    os.environ.update(speed.to_env())  # read by the mock engines here and in the inference servers
    with tempfile.TemporaryDirectory(prefix="mas-async-bench-") as tmp:
        run_dir = args.run_dir or Path(tmp) / "framework"
        config = build_config(args, run_dir)
        record = run_framework(config, args.warmup, args.timeout)
        framework = framework_figures(record)
        standalone = run_standalone(config, record)
    result = report(args, framework, standalone)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
