"""Bounded staleness (`rollout.max_staleness` k = 0, 1, 2) against the lockstep pattern, training included.

The workload is `bench/async_vs_lockstep.py`'s: code-env episodes (coder + tester, tree sampling with K
candidates, exactly `--turns` turns) whose candidates are the scripted programs of `bench.lockstep`
(reference solutions, wrong stubs, slow programs and hangs run in the sandbox), `--warmup` +
`--iterations` iterations of `--episodes` episodes, the same problems and seeds on every side.

1. mas-async, once per k, and once more for k=0 with the streamed step (`trainer.streaming`: each
   group's gradient computed as its turn is recorded, while the episodes play on; the k=0 side is the
   batch step): a
   TRAINING deployment through the launcher: the real router (recording the
   episodes it dispatches), one env worker, one inference server whose backend is `ScriptedEngine`
   (`policies.shared.backend=bench.lockstep:ScriptedEngine`; like the mock it accepts every weight
   broadcast and serves the next version), and the real trainer of the tiny model of
   configs/code_tiny_shared.yaml, stepping on the samples and broadcasting its weights after every
   iteration. Figures come from the run's metrics.jsonl: the measured window is `time/elapsed_s` from
   the end of the last warm-up iteration to the end of the last measured one.
2. lockstep: the reference implementation's pattern in this process: the k=0 run's episodes through
   `bench.lockstep.run_phase` (one batched generate call per turn for all episodes), then a training
   step. The reference trains synchronously after each rollout, so its step is COSTED, not run: a
   sleep of the `time/step_s` (step + weight sync) that the k=0 run measured for the same iteration.

Figures per side: rollout tokens per second and iterations per minute over the measured window, the
trainer's idle fraction (seconds it waited for a rollout, `time/trainer_idle_s`, less what a streamed
step computed meanwhile, over the window) and the servers' idle fraction (seconds with no episode in
flight, `time/inference_idle_s`; on the lockstep side the rollout keeps episodes in flight and the
costed step does not). Every side plays the same
scripted answers (a pure function of the prompt), so the token counts match and the ratios of tokens/s
and of iterations/min against lockstep agree. With k >= 1 the next iterations' rollouts run during the
step, so the trainer stops waiting for whole rollouts; what is left is bounded by how the machine's
cores are shared between the sandbox programs, the env worker, the server and the trainer. The streamed
strict step (k=0 streaming) overlaps the step's compute with its own iteration's rollout and keeps only
the tail (the compute left after the last group, the optimiser step, the weight sync) between rollouts;
its phase times per iteration are printed with an estimate of what a trainer on a device of its own
(its compute no longer taking the rollout's cores) would give. Every side's CPU is measured too (the
whole machine's busy time over its measured window): with it, what this machine's cores allow the
streamed step (its CPU per iteration spread perfectly over every core), and how busy it kept them.

    python bench/staleness.py              # several minutes on 2 cores
    python bench/staleness.py --smoke      # well under a minute; run by the tests
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.lockstep import ScriptedEngine, run_phase
from bench.machine_cpu import CpuTimeline
from mas_async.config import Config, load_config
from mas_async.launch.engines.local import LocalEngine
from mas_async.launch.launcher import prepare_deployment, prepare_run_dir, start_children, stop_children
from mas_async.launch.roles import ROLES as TRAINING_ROLES
from mas_async.router.hub import Router
from mas_async.throughput.run import wait_for_router

ROOT = Path(__file__).resolve().parents[1]

CONFIG = ROOT / "configs" / "code_tiny_shared.yaml"
POLICY = "shared"
TARGETS = {"k=0 streaming": 1.6, "k=1": 2.0, "k=2": 2.5}
"""side -> the speedup over lockstep that issues 15 (k=1, k=2) and 39 (strict, streamed) ask for."""
STREAMING = "k=0 streaming"


def build_config(args: argparse.Namespace, run_dir: Path, staleness: int, streaming: bool = False) -> Config:
    overrides = [
        f"run.output_dir={run_dir}",
        f"run.iterations={args.warmup + args.iterations}",
        "eval.every=0",
        "env.name=bench.lockstep:TimedCodeEnv",
        f"policies.{POLICY}.backend=bench.lockstep:ScriptedEngine",
        f"policies.{POLICY}.model=builtin:tiny-ascii",
        f"rollout.batch_size={args.episodes}",
        f"rollout.max_tokens={args.max_tokens}",
        f"rollout.max_staleness={staleness}",
        f"trainer.streaming={str(streaming).lower()}",  # k=0 is today's batch step unless streamed
        f"algorithm.k={args.candidates}",
        f"workflow.options.max_turns={args.turns}",
        "cluster.env_workers=1",  # one event loop of env steps, as on the lockstep side
        "trainer.checkpoint_every=0",  # only the final checkpoint, as every k has it
        # Gradients accumulate over micro-batches (the same step): one batch of all the long char-level
        # prompts of an iteration would hold tens of GiB of activations.
        "trainer.micro_batch_sequences=8",
    ]
    return load_config(CONFIG, overrides)


# -- the mas-async side: a training deployment --------------------------------------------------


class EpisodeRecordingRouter(Router):
    """The training router; also writes every training episode it dispatched (episodes.json)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
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
        (self.run_dir / "episodes.json").write_text(json.dumps(self.dispatched))
        await super().cleanup()


def _router(config: Config, deployment: Any, run_dir: Path, *, index: int, policy: str) -> Any:
    return EpisodeRecordingRouter(config, deployment, run_dir)


ROLES = {**TRAINING_ROLES, "router": _router}
"""The training deployment's roles with the recording router (started by the launcher)."""


def run_training(config: Config, timeout_s: float) -> tuple[Path, CpuTimeline]:
    """Run the training deployment to its end; raise naming the process that failed (with its log
    tail) or the timeout. Every process is stopped by pid before this returns. Returns the run dir and
    the machine's busy CPU over the run, with the time each metrics row appeared."""
    run_dir = prepare_run_dir(config)
    prepare_deployment(config, run_dir, training=True)
    engine = LocalEngine(config)
    try:
        with CpuTimeline(rows=run_dir / "metrics.jsonl") as cpu:
            children = start_children(config, run_dir, training=True, roles="bench.staleness:ROLES", engine=engine)
            try:
                wait_for_router(children, timeout_s)
            finally:
                stop_children(children)
    finally:
        engine.close()
    return run_dir, cpu


def training_figures(run_dir: Path, warmup: int, iterations: int, cpu: CpuTimeline) -> dict[str, Any]:
    """The measured iterations' figures from the run's metrics.jsonl (and the machine's CPU over them)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = {r["iteration"]: r for r in lines}
    line_of = {r["iteration"]: i for i, r in enumerate(lines)}
    measured = [rows[i] for i in range(warmup, warmup + iterations)]
    seconds = measured[-1]["time/elapsed_s"] - rows[warmup - 1]["time/elapsed_s"]  # warmup >= 1
    window = (cpu.row_seen[line_of[warmup - 1]], cpu.row_seen[line_of[warmup + iterations - 1]])
    tokens = sum(r["throughput/rollout_tokens_per_s"] * r["time/rollout_s"] for r in measured)
    key = f"policy/{POLICY}/"
    return {
        "seconds": seconds,
        "iterations": iterations,
        "episodes": sum(r["rollout/episodes"] for r in measured),
        "dropped": sum(r["rollout/dropped"] for r in measured),
        "tokens": round(tokens),
        "tokens_per_s": tokens / seconds,
        "iterations_per_min": 60 * iterations / seconds,
        # Waiting for the rollout, less what a streamed step computed meanwhile (the share before the last group).
        "trainer_idle_fraction": sum(
            r["time/trainer_idle_s"] - r[f"trainer/{POLICY}/compute_s"] * r[f"trainer/{POLICY}/overlap"]
            for r in measured
        )
        / seconds,
        "inference_idle_fraction": sum(r["time/inference_idle_s"] for r in measured) / seconds,
        "step_s": [rows[i]["time/step_s"] for i in range(warmup + iterations)],  # every iteration, for lockstep
        "cpu_s": cpu.busy_between(*window),  # the whole machine's, between the rows that bound the window
        "cpu_window_s": window[1] - window[0],
        # Strict runs (k=0) write no staleness keys: every sample is of the version it trains.
        "staleness_mean": sum(r.get(key + "staleness_mean", 0.0) for r in measured) / iterations,
        "staleness_max": max(r.get(key + "staleness_max", 0) for r in measured),
        "stale_dropped": sum(r.get(key + "stale_dropped", 0) for r in measured),
        "multi_version_token_fraction": sum(r["rollout/multi_version_token_fraction"] for r in measured) / iterations,
        # Phase times (per measured iteration): the rollout, the step after it (compute left + weight sync
        # and load), the trainer's compute in all and the share of it done while the rollout ran.
        "rollout_s": sum(r["time/rollout_s"] for r in measured) / iterations,
        "step_phase_s": sum(r["time/step_s"] for r in measured) / iterations,
        "compute_s": sum(r[f"trainer/{POLICY}/compute_s"] for r in measured) / iterations,
        "overlap": sum(r[f"trainer/{POLICY}/overlap"] for r in measured) / iterations,
        "tail_s": sum(r[f"trainer/{POLICY}/tail_s"] for r in measured) / iterations,
        # A streamed step's: the share of the samples ready (their problem complete) before the last group
        # came in, and how long before it the first problem was (what bounds the overlap).
        **{
            name: sum(r[f"trainer/{POLICY}/{name}"] for r in measured) / iterations
            for name in ("ready_early", "ready_lead_s")
            if all(f"trainer/{POLICY}/{name}" in r for r in measured)
        },
    }


# -- the lockstep side ---------------------------------------------------------------------------


def run_lockstep(config: Config, run_dir: Path, step_s: list[float], warmup: int) -> dict[str, Any]:
    """The recorded episodes, iteration by iteration, in lockstep, each rollout followed by a step costed
    at `step_s[iteration]` seconds (a sleep: nothing else runs meanwhile, as in a synchronous trainer)."""
    import uvloop

    from mas_async.inference.backends.base import ThreadedBackend
    from mas_async.launch.launcher import model_cache_dir
    from mas_async.rollout.env_worker import load_tokenizer, stop_token_ids
    from mas_async.tiny_model import materialise

    model_path = str(materialise(config.policies[POLICY].model, model_cache_dir()))
    backend = ThreadedBackend(ScriptedEngine(model_path, seed=config.run.seed * 1000))
    tokenizer = load_tokenizer(model_path)
    stops = stop_token_ids(tokenizer)
    episodes = json.loads((run_dir / "episodes.json").read_text())

    async def iterations() -> list[dict[str, Any]]:
        done = []
        for iteration, step in enumerate(step_s):
            phase = await run_phase(
                config, [e for e in episodes if e["iteration"] == iteration], backend, tokenizer, stops
            )
            await asyncio.sleep(step)
            done.append({**phase, "iteration": iteration, "step_s": step, "end": time.time()})
        return done

    with CpuTimeline() as cpu:
        phases = uvloop.run(iterations())
    measured = [p for p in phases if p["iteration"] >= warmup]
    seconds = measured[-1]["end"] - measured[0]["start"]
    rollout_s = sum(p["end"] - p["start"] - p["step_s"] for p in measured)
    tokens = sum(p["tokens"] for p in measured)
    return {
        "seconds": seconds,
        "iterations": len(measured),
        "episodes": sum(p["episodes"] for p in measured),
        "dropped": 0,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "iterations_per_min": 60 * len(measured) / seconds,
        "trainer_idle_fraction": rollout_s / seconds,
        "inference_idle_fraction": sum(p["step_s"] for p in measured) / seconds,
        "cpu_s": cpu.busy_between(measured[0]["start"], measured[-1]["end"]),
        "cpu_window_s": seconds,
    }


# -- report --------------------------------------------------------------------------------------


def report(args: argparse.Namespace, sides: dict[str, dict[str, Any]], same_episodes: bool) -> dict[str, Any]:
    lockstep = sides["lockstep"]
    print(
        f"bounded staleness vs lockstep: code env, {args.episodes} episodes x {args.iterations} iterations "
        f"(+{args.warmup} warm-up), K={args.candidates}, {args.turns} turns, {args.max_tokens} tokens per answer "
        f"at {args.mock_step_ms} ms/step; mas-async trains the tiny model, lockstep's step costed at the k=0 run's"
    )
    print(
        f"  {'side':<13} {'seconds':>8} {'tokens':>7} {'tokens/s':>9} {'iter/min':>9} {'trainer idle':>13} "
        f"{'server idle':>12} {'staleness':>10} {'ratio':>6}  target"
    )
    ratios = {}
    for name, side in sides.items():
        ratio = side["tokens_per_s"] / lockstep["tokens_per_s"]
        staleness = f"{side['staleness_mean']:.2f}/{side['staleness_max']:.0f}" if "staleness_mean" in side else "-"
        target = f">= {TARGETS[name]:.1f}x {'met' if ratio >= TARGETS[name] else 'NOT met'}" if name in TARGETS else ""
        if name != "lockstep":
            ratios[name] = ratio
        print(
            f"  {name:<13} {side['seconds']:>8.1f} {side['tokens']:>7d} {side['tokens_per_s']:>9.1f} "
            f"{side['iterations_per_min']:>9.2f} {side['trainer_idle_fraction']:>13.2f} "
            f"{side['inference_idle_fraction']:>12.2f} {staleness:>10} {ratio:>5.2f}x  {target}"
        )
    print(f"  same episodes (ids, problems, seeds) on every side: {'yes' if same_episodes else 'NO'}")
    print("ratios (tokens/s against lockstep): " + ", ".join(f"{k} {r:.2f}x" for k, r in ratios.items()))
    own_device = phases(sides)
    machine = machine_bound(sides)
    return {
        "bench": "staleness",
        "date": datetime.now().isoformat(timespec="seconds"),
        "args": vars(args),
        "sides": sides,
        "ratios": ratios,
        "same_episodes": same_episodes,
        "own_device_estimate": own_device,
        "machine_bound": machine,
    }


def machine_bound(sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Print each side's CPU (the whole machine's busy time over its measured window, per iteration, and
    the share of the cores it kept busy), and what this machine's cores allow the streamed step: its own
    CPU per iteration spread perfectly over every core, against lockstep's iteration. Lockstep's step is
    costed as a sleep, so its CPU is its rollout's alone."""
    cores = len(os.sched_getaffinity(0))
    figures = {
        name: {
            "cpu_s_per_iteration": side["cpu_s"] / side["iterations"],
            "busy": side["cpu_s"] / (cores * side["cpu_window_s"]),
        }
        for name, side in sides.items()
    }
    print(
        f"  machine CPU ({cores} cores, every process): "
        + ", ".join(
            f"{name} {f['cpu_s_per_iteration']:.1f} core-s/iter, {f['busy']:.0%} busy" for name, f in figures.items()
        )
    )
    out: dict[str, Any] = {"cores": cores, "sides": figures}
    if STREAMING in figures:
        lockstep = sides["lockstep"]["seconds"] / sides["lockstep"]["iterations"]
        packed = figures[STREAMING]["cpu_s_per_iteration"] / cores
        out.update(packed_seconds_per_iteration=packed, ratio_bound=lockstep / packed)
        print(
            f"  what this machine's cores allow the streamed step: its {figures[STREAMING]['cpu_s_per_iteration']:.1f} "
            f"core-s per iteration on {cores} cores, {packed:.2f} s (it took "
            f"{sides[STREAMING]['seconds'] / sides[STREAMING]['iterations']:.2f}): at most {lockstep / packed:.2f}x "
            f"lockstep's {lockstep:.2f} s"
        )
    return out


def phases(sides: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Print the strict sides' phase times per iteration, and what the streamed step would give with the
    trainer on a device of its own (the rollout no longer sharing the cores with the trainer's compute):
    an iteration of max(k=0's rollout, the step's compute) plus the streamed run's tail (the compute left
    after the last group, the optimiser step, the weight sync and load), against lockstep's iteration."""
    print(f"  {'phases/iter':<13} {'rollout':>8} {'step':>8} {'compute':>8} {'overlap':>8} {'tail':>8}")
    for name in ("k=0", STREAMING):
        if name in sides:
            side = sides[name]
            print(
                f"  {name:<13} {side['rollout_s']:>8.2f} {side['step_phase_s']:>8.2f} {side['compute_s']:>8.2f} "
                f"{side['overlap']:>8.2f} {side['tail_s']:>8.2f}"
            )
    if STREAMING not in sides:
        return {}
    strict, streamed = sides["k=0"], sides[STREAMING]
    iteration = max(strict["rollout_s"], strict["compute_s"]) + streamed["tail_s"]
    lockstep = sides["lockstep"]["seconds"] / sides["lockstep"]["iterations"]
    print(
        f"  a trainer on its own device (estimate): {iteration:.2f} s per iteration = max(rollout "
        f"{strict['rollout_s']:.2f}, compute {strict['compute_s']:.2f}) + tail {streamed['tail_s']:.2f}; "
        f"{lockstep / iteration:.2f}x lockstep's {lockstep:.2f} s"
    )
    estimate = {"seconds_per_iteration": iteration, "ratio": lockstep / iteration}
    if "ready_early" not in streamed:
        return estimate
    # The most a step can compute before the last group: the samples ready by then, and no more than the
    # time from the first complete problem to it. The rest of the tail (optimiser step, weight sync and
    # load) is the streamed run's tail less the compute it did after the last group.
    compute = streamed["compute_s"]
    early = min(streamed["ready_early"] * compute, streamed["ready_lead_s"])
    rest = max(0.0, streamed["tail_s"] - (1 - streamed["overlap"]) * compute)
    best = strict["rollout_s"] + compute - early + rest
    print(
        f"  what the rule allows (a group is computed once it is final): {streamed['ready_early']:.0%} of "
        f"the samples were ready before the last group, the first {streamed['ready_lead_s']:.2f} s before it; at "
        f"best (all of them computed by then) {best:.2f} s per iteration = rollout {strict['rollout_s']:.2f} + "
        f"compute left {compute - early:.2f} + step and sync {rest:.2f}: {lockstep / best:.2f}x lockstep"
    )
    return {**estimate, "bound_seconds_per_iteration": best, "bound_ratio": lockstep / best}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--staleness", default="0,1,2", help="values of rollout.max_staleness, comma-separated")
    p.add_argument(
        "--no-streaming", dest="streaming", action="store_false",
        help="leave out the k=0 run with the streamed step (trainer.streaming=true); k=0 is the batch step",
    )  # fmt: skip
    p.add_argument("--episodes", type=int, default=8, help="episodes per iteration (rollout.batch_size)")
    p.add_argument("--candidates", type=int, default=4, help="K: candidates per agent per turn")
    p.add_argument("--turns", type=int, default=4, help="turns of every episode")
    p.add_argument("--max-tokens", type=int, default=32, help="decode steps the engine charges per batch")
    p.add_argument("--iterations", type=int, default=3, help="measured iterations")
    p.add_argument("--warmup", type=int, default=1, help="iterations run first and not measured")
    p.add_argument("--mock-step-ms", type=float, default=10.0, help="ms per decode step of a batch")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds each mas-async run may take")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    p.add_argument("--run-dir", type=Path, help="keep the mas-async runs' directories here (default: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="a tiny run (well under a minute), for the tests")
    args = p.parse_args(argv)
    if args.smoke:
        args.staleness, args.episodes, args.candidates, args.turns, args.max_tokens = "0,1", 2, 2, 1, 8
        args.iterations, args.warmup, args.mock_step_ms, args.timeout = 1, 1, 1.0, 120.0
    args.staleness = [int(k) for k in str(args.staleness).split(",")]
    if args.warmup < 1:
        p.error("--warmup must be at least 1: the first iteration's row also counts the processes' start-up")
    if 0 not in args.staleness:
        p.error("--staleness must include 0: the lockstep side costs its steps at the k=0 run's")
    return args


def main(argv: list[str] | None = None) -> int:
    from mas_async.inference.backends.mock import MockSpeed

    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.update(MockSpeed(args.mock_step_ms / 1000).to_env())  # the server's and this process's engine
    sides: dict[str, dict[str, Any]] = {}
    episodes: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="mas-async-bench-") as tmp:
        base = args.run_dir or Path(tmp)
        runs = [(f"k={k}", k, False) for k in sorted(args.staleness)]
        if args.streaming:
            runs.insert(1, (STREAMING, 0, True))
        for name, k, streaming in runs:
            run_dir, cpu = run_training(build_config(args, base / name.replace(" ", "-"), k, streaming), args.timeout)
            sides[name] = training_figures(run_dir, args.warmup, args.iterations, cpu)
            episodes[name] = json.loads((run_dir / "episodes.json").read_text())
        lockstep = run_lockstep(build_config(args, base / "k=0", 0), base / "k=0", sides["k=0"]["step_s"], args.warmup)
    same = all(e == episodes["k=0"] for e in episodes.values())
    result = report(args, {"lockstep": lockstep, **sides}, same)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
