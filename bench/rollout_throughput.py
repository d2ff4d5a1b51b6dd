"""Rollout throughput of the framework against the standalone engine on the same prompts: a fixed
workload (Plan-Path, one shared policy) over `mas-async bench`'s measurement (`mas_async.throughput`).

1. Framework: a rollout-only deployment (the real router, env workers and inference servers as separate
   processes, no trainers) runs `--warmup` + `--iterations` rollout phases of Plan-Path training
   episodes (tree sampling, K candidates per agent per turn) with one policy, recording every phase's
   window, every generate request and every inference batch.
2. Standalone: the same engine, in this process with no framework around it, generates exactly the
   prompts the framework's episodes sent, in lockstep waves (`mas_async.throughput.figures.baseline`).

It prints rollout tokens/s, episodes/s, env steps/s, generation latency p50/p99, the inference servers'
busy fraction and the overhead ratio = framework tokens/s / standalone tokens/s (target >= 0.90). For any
other config, use `mas-async bench CONFIG --baseline`.

The framework runs with CURVE on every ZeroMQ socket (`cluster.curve`, the default). `--curve-ratio` runs
the same workload once more with plain sockets, in the same invocation, and prints the CURVE ratio =
median phase tokens/s with CURVE / without (target >= 0.90).

    python bench/rollout_throughput.py --backend mock --mock-step-ms 10    # a ~1.7B model on a GPU
    python bench/rollout_throughput.py --backend hf --model builtin:small-char
    python bench/rollout_throughput.py --curve-ratio                       # + the cost of CURVE
    python bench/rollout_throughput.py --smoke                             # seconds; run by the tests
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from mas_async.config import Config, load_config
from mas_async.machine_paths import without_machine_paths
from mas_async.throughput.command import measure

ROOT = Path(__file__).resolve().parents[1]

CONFIG = ROOT / "configs" / "plan_path_tiny_shared.yaml"
POLICY = "shared"


def build_config(args: argparse.Namespace, run_dir: Path) -> Config:
    return load_config(CONFIG, _overrides(args, run_dir))


def _overrides(args: argparse.Namespace, run_dir: Path) -> list[str]:
    return [
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


# -- the measurement -------------------------------------------------------------------------------


def run(config: Config, warmup: int, timeout_s: float, *, with_baseline: bool = True) -> tuple[dict, dict | None]:
    """The framework's figures and the standalone engine's (None without the baseline), in the shape this
    script reports."""
    result = measure(config, warmup=warmup, with_baseline=with_baseline, timeout_s=timeout_s)
    total = result["total"]
    framework = {
        "seconds": total["seconds"],
        "tokens": total["tokens"],
        "tokens_per_s": total["tokens_per_s"],
        "phase_tokens_per_s": total["phase_tokens_per_s"],
        "episodes_per_s": total["episodes_per_s"],
        "env_steps_per_s": total["env_steps_per_s"],
        "latency_p50_ms": total["latency_ms"]["p50"],
        "latency_p99_ms": total["latency_ms"]["p99"],
        "busy_fraction": float(np.mean([r["busy_fraction"] for r in result["replicas"].values()])),
        "dropped": total["dropped"],
    }
    return framework, result["baseline"][POLICY] if with_baseline else None


# -- report ----------------------------------------------------------------------------------------


def report(
    args: argparse.Namespace, framework: dict[str, Any], standalone: dict[str, Any], plain: dict[str, Any] | None
) -> dict[str, Any]:
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
    result = {
        "bench": "rollout_throughput",
        "date": datetime.now().isoformat(timespec="seconds"),
        "args": vars(args),
        "curve": args.curve,
        "framework": framework,
        "standalone": standalone,
        "overhead_ratio": ratio,
    }
    if plain is not None:
        phases = ", ".join(f"{x:.0f}" for x in plain["phase_tokens_per_s"])
        print(f"  {'tokens/s per phase':<36} {'no CURVE':<10} {phases}")
        with_curve = float(np.median(framework["phase_tokens_per_s"]))
        curve_ratio = with_curve / float(np.median(plain["phase_tokens_per_s"]))
        print(f"CURVE ratio (median phase tokens/s, with / without CURVE): {curve_ratio:.3f}   (target >= 0.90)")
        result |= {"framework_without_curve": plain, "curve_ratio": curve_ratio}
    return result


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
    p.add_argument(
        "--curve-ratio", action="store_true", help="run the framework again with cluster.curve=false (same workload)"
    )
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
        args.curve = config.cluster.curve
        framework, standalone = run(config, args.warmup, args.timeout)
        plain = None
        if args.curve_ratio:
            if not config.cluster.curve:
                raise SystemExit("--curve-ratio compares with the run with CURVE: drop cluster.curve=false")
            plain_config = load_config(CONFIG, [*_overrides(args, Path(tmp) / "plain"), "cluster.curve=false"])
            plain, _ = run(plain_config, args.warmup, args.timeout, with_baseline=False)
    result = report(args, framework, standalone, plain)
    if args.json:
        args.json.write_text(json.dumps(without_machine_paths(result), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
