"""mas-async against a turn-synchronous lockstep baseline, on code episodes whose env steps vary in time.

The workload: code-env training episodes (coder + tester in parallel each turn, tree sampling with K
candidates per agent per turn, exactly `--turns` turns each: see `mas_async/lockstep.py`), whose
candidate programs are real programs run in the sandbox: reference solutions, wrong stubs, slow
programs (0.2-1.0 s) and hangs (killed by the 2 s per-test alarm). Each side runs `--warmup` +
`--iterations` phases of `--episodes` episodes with a barrier between phases (on-policy training
waits for every episode of an iteration); only the measured phases are timed.

1. mas-async: a rollout-only deployment (`bench.support`): the real router, ONE env worker
   and one inference server as processes, talking over ZeroMQ; each episode runs on its own, and the
   server batches whatever requests are queued (dynamic batching).
2. lockstep: the reference implementation's pattern, in this process (`bench.lockstep`): the
   same episodes (the ids, problems and seeds the router dispatched), the same `Episode` and workflow
   code, but each turn ONE batched generate call for all episodes, sent only once every env of the
   previous turn has stepped.

Why the comparison is fair: both sides play the same problems with the same episode seeds, K,
turns, nodes, env and sandbox, so they make the same choices and run the same programs (the printed
answer kinds must match: "same workload: yes"). Both use `ScriptedEngine`, the mock engine's time
model (a batch of B sequences costs `max_tokens * (step + B * token)` seconds, one batch at a time),
so generating a turn costs the lockstep side no more than one batch: with `--mock-token-ms 0` (the
default) batching is free, which favours the lockstep side. Both run their env steps on one event
loop with the sandbox's same limit on concurrent runs (`mas_async.sandbox.capacity.max_concurrency`, a free slot
going to the episode furthest behind: on the lockstep side all are at the same turn, so that is arrival
order); the lockstep side pays no messaging or process overhead at all. What it measures: the time lost by waiting, every
turn, for the slowest env step of any episode before generating, against generating for each episode
as soon as its own steps are done. mas-async keeps its on-policy barrier, so each of its phases still
lasts as long as its slowest episode (printed): the speedup is the sum over turns of the slowest env
step of any episode against the slowest episode's own sum. It also depends on the ratio of generation
time (`--max-tokens` x `--mock-step-ms`) to execution time, and on the sandbox's throughput (cores).

    python bench/async_vs_lockstep.py              # about 3 minutes on 2 cores
    python bench/async_vs_lockstep.py --smoke      # seconds; run by the tests
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench.lockstep import CODER_MIX, ScriptedEngine, TimedCodeEnv, run_phase
from bench.support import BENCH_DIR, RolloutRouter, bench_dir, run_rollout
from mas_async.config import Config, load_config
from mas_async.inference.backends.base import ThreadedBackend
from mas_async.inference.server import InferenceServer
from mas_async.machine_paths import without_machine_paths
from mas_async.rollout.env_worker import EnvWorker

ROOT = Path(__file__).resolve().parents[1]

CONFIG = ROOT / "configs" / "code_tiny_shared.yaml"
POLICY = "shared"
ENV = "bench.lockstep:TimedCodeEnv"


def build_config(args: argparse.Namespace, run_dir: Path) -> Config:
    overrides = [
        f"run.output_dir={run_dir}",
        f"run.iterations={args.iterations}",
        "eval.every=0",
        "trainer.max_untrained_iterations=0",  # a speed bench: its mock tokens may teach nothing
        f"env.name={ENV}",
        f"policies.{POLICY}.backend=mock",
        f"policies.{POLICY}.model=builtin:tiny-ascii",
        f"rollout.batch_size={args.episodes}",
        f"rollout.max_tokens={args.max_tokens}",
        f"algorithm.k={args.k}",
        f"workflow.options.max_turns={args.turns}",
        "cluster.env_workers=1",  # one event loop of env steps, as on the lockstep side
    ]
    return load_config(CONFIG, overrides)


# -- the mas-async side: rollout-only actors that also write what this benchmark reads ----------


class EpisodeRouter(RolloutRouter):
    """Records every episode it dispatches (episodes.json), so the lockstep side replays them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dispatched: list[dict[str, Any]] = []

    def _episodes(self, iteration: int, version: int, train: bool, evaluate: bool) -> Iterator:
        for task in super()._episodes(iteration, version, train, evaluate):  # (recorded as the book takes it)
            m = task.msg
            self.dispatched.append(
                {"iteration": m.iteration, "episode_id": m.episode_id, "problem_id": m.problem_id,
                 "problem": m.problem, "seed": m.seed}
            )  # fmt: skip
            yield task

    async def cleanup(self) -> None:
        (bench_dir(self.run_dir) / "episodes.json").write_text(json.dumps(self.dispatched))
        await super().cleanup()


class StepTimingEnvWorker(EnvWorker):
    """Writes the seconds of every env step and of every episode it ran (steps.json)."""

    def __init__(self, config: Config, deployment: Any, index: int, run_dir: Path) -> None:
        super().__init__(config, deployment, index)
        self.run_dir = run_dir
        self.episode_seconds: list[tuple[int, float]] = []  # (iteration, seconds) of each episode

    async def _run_episode(self, msg: Any) -> None:
        start = time.time()
        await super()._run_episode(msg)
        self.episode_seconds.append((msg.iteration, time.time() - start))

    async def cleanup(self) -> None:
        record = {"steps": TimedCodeEnv.step_seconds, "episodes": self.episode_seconds}
        (bench_dir(self.run_dir) / "steps.json").write_text(json.dumps(record))


class ScriptedInferenceServer(InferenceServer):
    """An inference server whose engine is `ScriptedEngine`; writes its batches and answers (engine.json)."""

    def __init__(self, config: Config, deployment: Any, policy: str, replica: int, run_dir: Path) -> None:
        super().__init__(config, deployment, policy, replica)
        self.run_dir = run_dir
        self.engine = ScriptedEngine(deployment.weights_path(policy), seed=config.run.seed * 1000 + replica)
        self.backend = ThreadedBackend(self.engine)
        self.backend.version = deployment.start_version

    async def cleanup(self) -> None:
        stats = {"calls": self.engine.calls, "kinds": dict(self.engine.kinds)}
        (bench_dir(self.run_dir) / "engine.json").write_text(json.dumps(stats))


def _router(config: Config, deployment: Any, run_dir: Path, *, index: int, policy: str, warmup: int) -> Any:
    return EpisodeRouter(config, deployment, run_dir, warmup)


def _env_worker(config: Config, deployment: Any, run_dir: Path, *, index: int, policy: str, warmup: int) -> Any:
    return StepTimingEnvWorker(config, deployment, index, run_dir)


def _inference(config: Config, deployment: Any, run_dir: Path, *, index: int, policy: str, warmup: int) -> Any:
    return ScriptedInferenceServer(config, deployment, policy, index, run_dir)


ROLES = {"router": _router, "env_worker": _env_worker, "inference": _inference}
"""The mas-async side's roles, started by the launcher (`bench.support.run_rollout`)."""


def run_framework(config: Config, warmup: int, timeout_s: float) -> dict[str, Any]:
    """Run the rollout-only deployment (this script's actors) to the end; return what was recorded."""
    run_dir, deployment = run_rollout(config, warmup=warmup, timeout_s=timeout_s, roles="bench.async_vs_lockstep:ROLES")
    out = run_dir / BENCH_DIR
    phases = json.loads((out / "phases.json").read_text())["phases"]
    engine = json.loads((out / "engine.json").read_text())
    steps = json.loads((out / "steps.json").read_text())
    measured = {p["iteration"] for p in phases if not p["warmup"]}
    return {
        "phases": phases,
        "episodes": json.loads((out / "episodes.json").read_text()),
        "steps": steps["steps"],
        "episode_seconds": [pair for pair in steps["episodes"] if pair[0] in measured],  # (iteration, s)
        "calls": engine["calls"],
        "kinds": engine["kinds"],
        "model_path": deployment.model_paths[POLICY],
    }


# -- the lockstep side ---------------------------------------------------------------------------


def run_lockstep(config: Config, record: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Replay the episodes the router dispatched, phase by phase, in lockstep, in this process."""
    import uvloop

    from mas_async.rollout.env_worker import load_tokenizer, stop_token_ids

    model_path = record["model_path"]
    engine = ScriptedEngine(model_path, seed=config.run.seed * 1000)
    backend = ThreadedBackend(engine)
    tokenizer = load_tokenizer(model_path)
    stops = stop_token_ids(tokenizer)
    iterations = sorted({e["iteration"] for e in record["episodes"]})
    TimedCodeEnv.step_seconds.clear()

    async def phases() -> list[dict[str, Any]]:
        done = []
        for iteration in iterations:
            episodes = [e for e in record["episodes"] if e["iteration"] == iteration]
            phase = await run_phase(config, episodes, backend, tokenizer, stops)
            del phase["samples"]  # (no trainer on either side here)
            done.append({**phase, "iteration": iteration, "warmup": iteration < warmup})
        return done

    return {
        "phases": uvloop.run(phases()),
        "steps": list(TimedCodeEnv.step_seconds),
        "calls": engine.calls,
        "kinds": dict(engine.kinds),
    }


# -- report --------------------------------------------------------------------------------------


def figures(record: dict[str, Any]) -> dict[str, Any]:
    measured = [p for p in record["phases"] if not p["warmup"]]
    seconds = sum(p["end"] - p["start"] for p in measured)
    episodes = sum(p["episodes"] for p in measured)
    steps = np.array(record["steps"])
    return {
        "seconds": seconds,
        "episodes": episodes,
        "turns": float(sum(p["turns"] for p in measured)),
        "episodes_per_s": episodes / seconds,
        "phase_seconds": [p["end"] - p["start"] for p in measured],
        "generate_calls": record["calls"],
        "env_steps": len(steps),
        "step_p50_s": float(np.percentile(steps, 50)),
        "step_p99_s": float(np.percentile(steps, 99)),
        "step_max_s": float(steps.max()),
        "kinds": record["kinds"],
    }


def barrier_line(framework: dict[str, Any], ours: dict[str, Any]) -> str:
    """What bounds mas-async: each phase waits for its slowest episode (the on-policy barrier)."""
    by_phase: dict[int, list[float]] = {}
    for iteration, seconds in framework["episode_seconds"]:
        by_phase.setdefault(iteration, []).append(seconds)
    mean = np.mean([s for phase in by_phase.values() for s in phase])
    slowest = np.mean([max(phase) for phase in by_phase.values()])
    return (
        f"  mas-async episode seconds: mean {mean:.2f}, slowest of each phase {slowest:.2f} on average, "
        f"and a phase lasts {np.mean(ours['phase_seconds']):.2f}: it waits for its slowest episode"
    )


def report(args: argparse.Namespace, ours: dict[str, Any], lockstep: dict[str, Any], barrier: str) -> dict[str, Any]:
    from mas_async.sandbox import Limits
    from mas_async.sandbox.capacity import max_concurrency

    concurrency = max_concurrency(Limits().memory_bytes)

    speedup = lockstep["seconds"] / ours["seconds"]
    same = ours["kinds"] == lockstep["kinds"] and ours["episodes"] == lockstep["episodes"]
    print(
        f"async vs lockstep: code env, {args.episodes} episodes x {args.iterations} phases (+{args.warmup} warm-up), "
        f"K={args.k}, {args.turns} turns; mock engine {args.mock_step_ms} ms/step + {args.mock_token_ms} ms/seq, "
        f"{args.max_tokens} tokens per answer ({args.max_tokens * args.mock_step_ms / 1000:.2f} s per batch); "
        f"sandbox: {concurrency} runs at once; coder answers {CODER_MIX}"
    )
    rows = [
        ("episodes (measured)", "episodes", "d"),
        ("turns (measured)", "turns", ".0f"),
        ("wall seconds (measured phases)", "seconds", ".2f"),
        ("episodes/s", "episodes_per_s", ".3f"),
        ("generate batches (all phases)", "generate_calls", "d"),
        ("env steps (all phases)", "env_steps", "d"),
        ("env step seconds p50", "step_p50_s", ".3f"),
        ("env step seconds p99", "step_p99_s", ".3f"),
        ("env step seconds max", "step_max_s", ".3f"),
    ]
    for label, key, spec in rows:
        print(f"  {label:<32} mas-async {format(ours[key], spec):>9}   lockstep {format(lockstep[key], spec):>9}")
    for name, side in (("mas-async", ours), ("lockstep", lockstep)):
        print(f"  {'seconds per phase':<32} {name:<9} {', '.join(f'{s:.2f}' for s in side['phase_seconds'])}")
    print(barrier)
    kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(ours["kinds"].items()))
    print(f"  answers (all phases): {kinds}; same workload on both sides: {'yes' if same else 'NO'}")
    if not same:
        print(f"  WARNING: lockstep answers differ: {lockstep['kinds']}")
    print(f"speedup (lockstep seconds / mas-async seconds): {speedup:.2f}x   (target >= 1.5)")
    return {
        "bench": "async_vs_lockstep",
        "date": datetime.now().isoformat(timespec="seconds"),
        "args": vars(args),
        "mas_async": ours,
        "lockstep": lockstep,
        "same_workload": same,
        "speedup": speedup,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=8, help="episodes per phase (rollout.batch_size)")
    p.add_argument("--k", type=int, default=4, help="candidates per agent per turn")
    p.add_argument("--turns", type=int, default=4, help="turns of every episode")
    p.add_argument("--max-tokens", type=int, default=32, help="decode steps the engine charges per batch")
    p.add_argument("--iterations", type=int, default=3, help="measured phases")
    p.add_argument("--warmup", type=int, default=1, help="phases run first and not measured")
    p.add_argument("--mock-step-ms", type=float, default=10.0, help="ms per decode step of a batch")
    p.add_argument("--mock-token-ms", type=float, default=0.0, help="extra ms per sequence per decode step")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the mas-async run may take")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    p.add_argument("--run-dir", type=Path, help="keep the mas-async run's directory here (default: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="a tiny run (seconds), for the tests")
    args = p.parse_args(argv)
    if args.smoke:
        args.episodes, args.k, args.turns, args.max_tokens, args.iterations, args.warmup = 2, 2, 2, 8, 1, 0
        args.mock_step_ms, args.timeout = 1.0, 120.0
    return args


def main(argv: list[str] | None = None) -> int:
    from mas_async.inference.backends.mock import MockSpeed

    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.update(MockSpeed(args.mock_step_ms / 1000, args.mock_token_ms / 1000).to_env())  # both sides
    with tempfile.TemporaryDirectory(prefix="mas-async-bench-") as tmp:
        config = build_config(args, args.run_dir or Path(tmp) / "framework")
        framework = run_framework(config, args.warmup, args.timeout)
        lockstep = run_lockstep(config, framework, args.warmup)
    ours = figures(framework)
    result = report(args, ours, figures(lockstep), barrier_line(framework, ours))
    if args.json:
        args.json.write_text(json.dumps(without_machine_paths(result), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
