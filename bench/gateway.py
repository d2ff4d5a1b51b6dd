"""Rollout throughput through the OpenAI-compatible gateway against the same workflow written as node
classes, measured in the same run on the mock backend.

Two rollout-only deployments of Plan-Path's two movers (`mas-async bench`'s measurement: router, env
workers, one mock inference server per policy), the same problems, sampling (parallel, K episodes per
problem), turns and decoding:

- gateway: `configs/examples/openai_movers.yaml`, the workflow program `nodes/examples/openai_movers.py`
  whose every call goes through the env worker's gateway with the `openai` package (HTTP, JSON, the chat
  template, the exact-token bookkeeping);
- node classes (the raw baseline): `configs/plan_path_tiny.yaml` set to the same sampling, batch, turns and
  decoding: the shipped `PlanPathWorkflow` and its mover nodes, which call the env worker's `generate`
  directly.

The mock backend charges the same time per batch whatever the prompt, so what differs is the work around
each call. The figure is generate requests per second (one per agent turn: both sides play the same turns
of the same problems, up to the goal), and the ratio gateway / node classes, per round, the two sides
alternating; printed as the median and range of `--rounds` rounds. Episodes/s and turns per episode are
printed beside it (an episode ends early on the goal, which a random move reaches now and then).

The mock answers at once by default: the ratio is then the gateway's overhead alone, the strictest test.
`--mock-step-ms` makes every call take that long (one decode step; `rollout.max_tokens` is 1), which
shows what the overhead costs when calls take as long as a model's: the env worker's extra CPU per call
matters only while it, not the replies, bounds the rollout.

    python bench/gateway.py                      # 3 rounds, a few minutes on 2 cores
    python bench/gateway.py --mock-step-ms 100   # calls of 100 ms each
    python bench/gateway.py --smoke              # 1 round, 1 short phase; run by the tests
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from mas_async.config import Config, load_config
from mas_async.inference.backends.mock import MockSpeed
from mas_async.throughput.command import measure

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.9
"""Issue 40: gateway requests/s at least 0.9 of the node classes' on the mock backend (median of 3)."""


def configs(args: argparse.Namespace, run_dir: Path) -> dict[str, Config]:
    """The two sides' configs: everything that shapes the rollout set alike."""
    common = [
        f"run.iterations={args.warmup + args.phases}",
        "eval.every=0",
        "policies.vertical.backend=mock",
        "policies.horizontal.backend=mock",
        "algorithm.sampling=parallel",
        "algorithm.grouping=agent",  # (a rollout-only measurement: the grouping does not change the rollout)
        f"algorithm.k={args.k}",
        f"rollout.batch_size={args.problems}",
        "rollout.max_tokens=1",
        "cluster.env_workers=1",
    ]
    return {
        "gateway": load_config(
            ROOT / "configs/examples/openai_movers.yaml",
            [*common, f"run.output_dir={run_dir / 'gateway'}", f"workflow.options.max_turns={args.turns}"],
        ),
        "node classes": load_config(
            ROOT / "configs/plan_path_tiny.yaml",
            [*common, f"run.output_dir={run_dir / 'nodes'}", f"workflow.options.max_turns={args.turns}"],
        ),
    }


def side_figures(result: dict[str, Any]) -> dict[str, float]:
    total = result["total"]
    episodes = total["episodes_per_s"] * total["seconds"]
    return {
        "requests_per_s": total["requests"] / total["seconds"],
        "episodes_per_s": total["episodes_per_s"],
        "requests_per_episode": total["requests"] / episodes if episodes else float("nan"),
        "latency_p50_ms": total["latency_ms"]["p50"],
        "dropped": total["dropped"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.update(MockSpeed(args.mock_step_ms / 1000).to_env())  # (the mock servers inherit it)
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="gateway-bench-") as tmp:
        for index in range(args.rounds):
            sides = configs(args, Path(tmp) / f"round-{index}")
            figures = {}
            for name, config in sides.items():
                result = measure(config, warmup=args.warmup, with_baseline=False, timeout_s=args.timeout)
                figures[name] = side_figures(result)
                if figures[name]["dropped"]:
                    raise RuntimeError(f"round {index}, {name}: {figures[name]['dropped']:.0f} episodes dropped")
            rounds.append(figures)
            ratio = figures["gateway"]["requests_per_s"] / figures["node classes"]["requests_per_s"]
            print(
                f"round {index + 1}: gateway {figures['gateway']['requests_per_s']:.1f} requests/s, node classes "
                f"{figures['node classes']['requests_per_s']:.1f}: {ratio:.2f}x",
                flush=True,
            )
    return {"rounds": rounds}


def report(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    rounds = result["rounds"]
    ratios = [r["gateway"]["requests_per_s"] / r["node classes"]["requests_per_s"] for r in rounds]
    print(
        f"gateway vs node classes: Plan-Path movers, {args.problems} problems x K={args.k} episodes per phase, "
        f"up to {args.turns} turns, mock backend ({args.mock_step_ms:g} ms a call), {args.phases} phases "
        f"(+{args.warmup} warm-up) per side, "
        f"{len(rounds)} rounds"
    )
    print(f"  {'side':<13} {'requests/s':>18} {'episodes/s':>18} {'requests/episode':>17} {'latency p50 ms':>15}")
    for name in ("node classes", "gateway"):

        def spread(key: str, name: str = name) -> str:
            values = [r[name][key] for r in rounds]
            return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"

        print(
            f"  {name:<13} {spread('requests_per_s'):>18} {spread('episodes_per_s'):>18} "
            f"{spread('requests_per_episode'):>17} {spread('latency_p50_ms'):>15}"
        )
    median = statistics.median(ratios)
    judged = args.mock_step_ms == 0  # (the target is the overhead alone: calls that take no time)
    verdict = ("met" if median >= TARGET else "NOT met") if judged else "judged with --mock-step-ms 0 only"
    print(
        f"  ratio gateway / node classes (requests/s): median {median:.2f}x, range {min(ratios):.2f}-"
        f"{max(ratios):.2f}x; target >= {TARGET}: {verdict}"
    )
    return {
        "ratios": ratios,
        "median": median,
        "target": TARGET,
        **({"target_met": median >= TARGET} if judged else {}),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds, each side measured once per round")
    p.add_argument("--problems", type=int, default=8, help="problems per phase (rollout.batch_size)")
    p.add_argument("--k", type=int, default=4, help="episodes per problem (algorithm.k)")
    p.add_argument("--turns", type=int, default=6, help="the most turns of an episode")
    p.add_argument("--phases", type=int, default=3, help="measured rollout phases per side")
    p.add_argument("--warmup", type=int, default=1, help="rollout phases run first, not measured")
    p.add_argument("--mock-step-ms", type=float, default=0.0, help="ms the mock takes per call (0: at once)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one side may take")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    p.add_argument("--smoke", action="store_true", help="1 round of 1 short phase, for the tests")
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.problems, args.phases, args.turns = 1, 2, 1, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    summary = report(args, result)
    if args.json:
        payload = {"bench": "gateway", "date": datetime.now().isoformat(timespec="seconds"), "args": vars(args)}
        args.json.write_text(json.dumps({**payload, **result, **summary}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
