"""Scale simulator of the control plane: the real router against hundreds of simulated peers.

This file is the entry point (the runs and their options); the parts, each readable and tested alone:
`bench/scale_peers.py` (the simulated peers and the ping peer), `bench/scale_sweep.py` (one point of the
load sweep: the router and the simulators started, measured over a window, torn down), `bench/scale_deployment.py`
(the deployment arithmetic: service times, offered loads, saturation, the router's CPU at a deployment's load)
and `bench/scale_report.py` (the table, the deployment check's lines, the plot).

The middle is the real router process (`python -m mas_async.launch.process router`, as `bench/router.py`
starts it, configured as a training run with one shared policy). Every other process of a deployment is
simulated by a few worker processes (`--procs`), each running its share of the peers as asyncio callbacks
and tasks on uvloop, one DEALER socket per simulated peer, each joining with a Hello as the real peers do:

- inference replicas: continuous batching of up to B requests at once; a request's service time is
  `tokens_per_turn * K / per-request rate`, the rate being `tokens_per_s_per_gpu * gpus_per_replica / B`
  (every request of a full batch decodes at the same rate). The result is sent back with the real
  GenerateResult's frames (K completions of `tokens_per_turn` tokens and log-probs). On UpdateWeights a
  replica reports WeightsLoaded, as a real one does after the broadcast;
- env workers: each runs the episodes the router dispatches to it (RunEpisode, up to its Hello capacity);
  an episode is T turns of: Generate (n = K, a prompt of P token ids), wait for the result, an env step
  drawn from a lognormal (`--env-step-ms` median, `--env-step-sigma`); then what the real env worker
  sends at the end of an episode: its Groups (T * K samples of P + tokens_per_turn tokens) and EpisodeDone;
- the trainer: counts the samples that reach it (and checks each TrainStep's expected count), and
  answers TrainStep(v) after `--step-ms` with UpdateWeights(v+1) and Trained(v+1), so iterations go on;
- every peer sends a Heartbeat each heartbeat interval in which it sent nothing else, as the real ones do
  (`cluster.heartbeat_s`, `--heartbeat-s`, 1 s, or processes / `cluster.heartbeats_per_s` (500) where that is
  longer: 2.2 s at 1,024 replicas and 64 env workers);
- the ping peer, in a process of its own: one more env worker of capacity 0 (never given an episode) that sends
  the router a Generate for a policy nobody serves every `--ping-ms` (10 ms), which the router answers at once
  through its whole receive, dispatch and send path. Its threads run at real-time priority (SCHED_FIFO, where the
  user may set it: root), so that on cores the simulators saturate its round trip is not its own wait for a core.
  Beside it, on the same idle loop, the probe worker: the last of the point's env workers (its share of the
  episodes, run as the simulated workers run theirs), moved out of the simulators so that its EpisodeDone to its
  next RunEpisode is the router's delay, not a saturated simulator's wait for its own loop.

With `--leases` (the default; `cluster.leases: true` in the router's config) each replica also binds a
direct socket and says its endpoint in its Hello; the router leases replicas to env workers (`Lease`), and an
env worker sends each Generate straight to the leased replica with the fewest of its requests outstanding,
which answers straight back. The trainer binds a direct socket too (its own key, its endpoint in its Hello),
which the router names to every env worker (`Trainers`): a worker sends each episode's Groups there (the rank
of RunEpisode.trainer_ranks), and the trainer counts them once the router's `Accepted` names that episode's
attempt, worker and sample count, waiting a bounded `GROUPS_WAIT_S` before a step for groups still on their
way. The router sees episodes, steps and heartbeats, neither requests nor samples. `--routed-groups` keeps
the Groups on the router (the fallback it still takes from a worker with no trainer link); `--no-leases`
measures the routed path (every Generate, result and Groups through the router).

The run keeps `rollout.max_staleness` = `--staleness` iterations ahead open, each iteration a batch of
`--iteration-episodes` (by default of the sweep: the concurrent episodes over staleness + 1).

A point of the sweep is (replicas, concurrent episodes E). E sets the offered load: the requests/s the
episodes would send if the control plane added nothing, L = E / cycle, cycle = service time + mean env step
(with the defaults, 4,096 episodes offer ~6,900 requests/s), on ceil(E / C) env workers (`--episodes-per-worker`
C). So that replicas never queue (the router is what is measured), a replica of a point serves max(B, ceil(E / replicas))
requests at once, each at the same service time. Per point, over a measured window after a warm-up:
requests/s (through the router, or straight to the replicas with leases); router CPU per request (user + system of the router process, delta over the
window / requests answered in it); the latency the control plane adds to each request, measured per
request (the end-to-end time seen by the env worker minus the service time its replica measured for it,
receipt to send), p50 and p99; requests in transit (Little's law: requests/s * mean added latency); router
RSS; samples/s reaching the trainer; episodes done/s and the router's CPU per episode done (with leases
the router's work is per episode, not per request); the simulator's own event-loop lag (it is inside the added latency);
over the whole run, the Groups sent through the router and straight, and the trainer's accepted and
delivered episodes (`GROUP_COUNTS`); the router log's warnings up to the window's end;
and per replica count the saturation point: where requests/s stops growing with the offered load (below
0.85 of the lowest point's achieved/offered ratio) or p99 added latency passes `--p99-bound-ms`.

What messages wait in the router, p50, p99 and max over the window, each from when the message was due (its
place in the ping peer's pace; the env step's end or the trainer's answer before an EpisodeDone; the step's end
before an UpdateWeights), not from when it actually went, so a late sender hides no delay (no coordinated
omission): the ping peer's round trip; the probe worker's EpisodeDone to its next RunEpisode, where the router had
an episode to give (its iteration was open), and the same of the simulated workers (printed beside: their loops'
lag is inside it); a step's UpdateWeights to the last replica's WeightsLoaded. The loop
lag alone does not show these: receiving, sending and dispatching are bounded per turn of the router's loop,
so a backlog waits in ZeroMQ's queues while a timer between the slices fires on time.

Then the deployment check: a deployment of N GPUs at R tokens/s/GPU, T tokens per turn, K candidates per
request sends N * R / (T * K) requests/s; with leases and Groups straight to the trainers the router sees
episodes, not requests, so its load is that rate over the turns per episode (`--deployment-turns`). The
router's CPU at that load is measured where a point reached it (`--turns 1`: the same episodes/s from fewer
simulated requests), else read from the line through the loads measured (`--iteration-episodes`: one
iteration size at every load), else bounded by the CPU per episode at the most load; routed traffic (every
request through the router) measured below the load gets no figure: "does not keep up" where the line through
the loads fills one core before it. The loop's lag is the p99 over all the window's ticks (the router's metrics
rows count them: router/loop_lag.py). One core of this machine is taken as one server core (a fixed
pure-Python workload's time is printed beside it, to compare machines).

The default run is the 1,024-GPU deployment at its load, as a training run has its router: 1,024 replicas,
2,048 and 4,096 concurrent 1-turn episodes (their episodes/s are what the deployment's 4-turn episodes send,
`--deployment-turns 4`), strict (k = 0) in iterations of 8,192 episodes, leases, TensorBoard on, INFO logging.
`--sweep` is the sweep of 64, 256 and 1,024 replicas at 256 to 4,096 concurrent 4-turn episodes (k = 1).

    python bench/scale.py                                   # the deployment's load (~1 min on 2 cores)
    python bench/scale.py --router-core 0                   # the same, the router on a core of its own
    python bench/scale.py --sweep --json F.json --plot docs/images/scale.png  # the sweep (~3 min on 2 cores)
    python bench/scale.py --gpus 256 --tokens-per-turn 200  # the check for another deployment
    python bench/scale.py --no-leases --sweep               # routed traffic: every request through the router
    python bench/scale.py --smoke                           # seconds; run by the tests
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import mas_async
from bench.scale_deployment import core_calibration, cycle_s, service_s
from bench.scale_report import plot, report
from bench.scale_sweep import measure_point
from mas_async.machine_paths import without_machine_paths

PRESET = object()
"""The default of an option whose value depends on the run (`RUNS`): the run's, unless the option is given."""
RUNS: dict[str, dict[str, Any]] = {
    # The deployment checked, at its load: 1,024 replicas, 1-turn episodes reaching the episodes/s that the
    # deployment's 4-turn ones send, strict (k = 0, iterations of 8,192 episodes: a freed slot is refilled
    # within an iteration), leases, TensorBoard and INFO logging on, as a training run has them.
    "deployment": {"replicas": [1024], "episodes": [2048, 4096], "turns": 1, "prompt_tokens": 64,
                   "deployment_turns": 4, "iteration_episodes": 8192, "staleness": 0, "seconds": 20.0},
    # The sweep of replica counts and loads: requests/s against the offered load, the saturation point.
    "sweep": {"replicas": [64, 256, 1024], "episodes": [256, 1024, 2048, 4096], "turns": 4, "prompt_tokens": 512,
              "deployment_turns": None, "iteration_episodes": None, "staleness": 1, "seconds": 6.0},
    "smoke": {"replicas": [6], "episodes": [8, 16], "turns": 2, "prompt_tokens": 512, "deployment_turns": None,
              "iteration_episodes": None, "staleness": 1, "seconds": 2.0, "procs": 2, "episodes_per_worker": 4,
              "warmup": 1.0, "batch": 1, "step_ms": 20.0},  # (133 ms per request)
}  # fmt: skip
"""Each run's values of the options it sets (`--sweep`, `--smoke`, else the deployment's)."""
DEFAULTS = {"procs": 2, "episodes_per_worker": 64, "warmup": 3.0, "batch": 4, "step_ms": 100.0}
"""The values of the options a run may set, where it does not."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sweep", action="store_true", help="the sweep of replica counts and loads (default: the deployment's load)"
    )
    p.add_argument("--replicas", type=int, nargs="+", default=PRESET, help="replica counts swept")
    p.add_argument("--episodes", type=int, nargs="+", default=PRESET,
                   help="concurrent episodes swept: the offered load is episodes / cycle requests/s")  # fmt: skip
    p.add_argument("--k", type=int, default=4, help="candidates per request (n)")
    p.add_argument("--prompt-tokens", type=int, default=PRESET)
    p.add_argument("--tokens-per-turn", type=int, default=100, help="tokens per completion")
    p.add_argument("--tokens-per-s-per-gpu", type=float, default=3000.0, help="a GPU's decode rate at full batch")
    p.add_argument("--gpus-per-replica", type=int, default=1)
    p.add_argument("--batch", type=int, default=PRESET, help="B: requests a replica decodes at once, at full rate")
    p.add_argument("--turns", type=int, default=PRESET, help="T: turns per episode (one Generate each)")
    p.add_argument("--env-step-ms", type=float, default=50.0, help="median env step (lognormal)")
    p.add_argument("--env-step-sigma", type=float, default=0.5, help="sigma of the env step's lognormal")
    p.add_argument("--episodes-per-worker", type=int, default=PRESET, help="C: concurrent episodes per env worker")
    p.add_argument("--staleness", type=int, default=PRESET, help="rollout.max_staleness of the simulated run")
    p.add_argument(
        "--iteration-episodes", type=int, default=PRESET,
        help="episodes per iteration (rollout.batch_size) at every point; none: each point's concurrent episodes "
        "over staleness + 1. The deployment check reads the router's CPU as a line through the loads only where "
        "their iterations are of one size",
    )  # fmt: skip
    p.add_argument("--step-ms", type=float, default=PRESET, help="the simulated trainer's step")
    p.add_argument("--procs", type=int, default=PRESET, help="simulator processes the peers are packed into")
    p.add_argument("--curve", action=argparse.BooleanOptionalAction, default=True, help="CURVE on every socket")
    p.add_argument(
        "--leases", action=argparse.BooleanOptionalAction, default=True,
        help="cluster.leases: env workers send Generate straight to the replicas the router leases them",
    )  # fmt: skip
    p.add_argument(
        "--routed-groups", action="store_true",
        help="with leases, env workers send their Groups through the router (its fallback for a worker with no "
        "trainer link), not straight to the trainer",
    )  # fmt: skip
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="cluster.heartbeat_s, of the router and the peers")
    p.add_argument(
        "--tensorboard", action=argparse.BooleanOptionalAction, default=True,
        help="metrics.tensorboard of the router (on, as in a training run)",
    )  # fmt: skip
    p.add_argument("--log-level", default="INFO", help="the router's log level (INFO, as in a training run)")
    p.add_argument("--ping-ms", type=float, default=10.0, help="the ping peer's pace: one ping every this many ms")
    p.add_argument(
        "--ping-priority", choices=("real-time", "normal"), default="real-time",
        help="the ping peer's scheduling: SCHED_FIFO where this user may set it (root), or the simulators' own",
    )  # fmt: skip
    p.add_argument(
        "--router-core", type=int,
        help="run the router on this core alone and everything else on the others (as on a server, where the "
        "router has a core of its own): its loop's lag is then its own delay",
    )  # fmt: skip
    p.add_argument("--warmup", type=float, default=PRESET, help="seconds after every peer joined, before counting")
    p.add_argument("--seconds", type=float, default=PRESET, help="the measured window per point")
    p.add_argument("--gpus", type=int, default=1024, help="the deployment checked")
    p.add_argument(
        "--deployment-turns", type=int, default=PRESET,
        help="turns per episode of the deployment checked (none: --turns): its requests/s in episodes/s, the "
        "router's load with leases",
    )  # fmt: skip
    p.add_argument("--p99-bound-ms", type=float, default=5.0, help="added latency and message delay target, p99")
    p.add_argument("--cpu-target", type=float, default=0.5, help="router CPU target, cores")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    p.add_argument("--plot", type=Path, help="draw requests/s, p99 added latency and router CPU against load")
    p.add_argument("--profile", type=Path, help="run the router under cProfile, writing its stats here (one point)")
    p.add_argument("--smoke", action="store_true", help="a tiny run (seconds), for the tests")
    args = p.parse_args(argv)
    run = RUNS["smoke" if args.smoke else "sweep" if args.sweep else "deployment"]
    for name, value in vars(args).items():
        if value is PRESET:
            setattr(args, name, run.get(name, DEFAULTS.get(name)))
    if args.deployment_turns is not None and args.deployment_turns < 1:
        p.error(f"--deployment-turns must be at least 1, got {args.deployment_turns}")
    if args.iteration_episodes is not None and args.iteration_episodes < 1:
        p.error(f"--iteration-episodes must be at least 1, got {args.iteration_episodes}")
    if args.ping_ms <= 0:
        p.error(f"--ping-ms must be positive, got {args.ping_ms}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The router and the simulators run the code this process runs (another checkout may be installed
    # meanwhile: its config keys would differ).
    code = str(Path(mas_async.__file__).resolve().parents[1])
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (code, os.environ.get("PYTHONPATH")) if p)
    calibration_s = core_calibration()
    points = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mas-async-bench-scale-") as tmp:
        for replicas in args.replicas:
            for episodes in args.episodes:
                point = measure_point(args, replicas, episodes, Path(tmp) / f"r{replicas}-e{episodes}")
                points.append(point)
                print(
                    f"  [{time.monotonic() - started:.0f}s] {replicas} replicas, offered {point['offered_rps']:.0f}: "
                    f"{point['rps']:.0f} req/s, p99 {point['added_p99_ms']:.2f} ms, router {point['router_cores']:.2f} "
                    f"cores",
                    flush=True,
                )
    summary = report(args, points, calibration_s)
    if args.plot:
        plot(points, args.plot, args.p99_bound_ms, args.cpu_target, alone=args.router_core is not None)
        print(f"plot: {args.plot}")
    if args.json:
        result = {
            "bench": "scale",
            "date": datetime.now().isoformat(timespec="seconds"),
            "args": vars(args),
            "service_ms": service_s(args) * 1000,
            "cycle_ms": cycle_s(args) * 1000,
            "core_calibration_s": calibration_s,
            "points": points,
            **summary,
        }
        args.json.write_text(json.dumps(without_machine_paths(result), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
