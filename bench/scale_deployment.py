"""The scale bench's deployment arithmetic (bench/scale.py): the model of a deployment (service time, the cycle
of a turn, the requests/s of N GPUs, what a point of the sweep runs), the saturation point of a replica count,
and whether one router keeps up with a deployment (its CPU at the deployment's load: measured at a point of
that load, else from the line through the loads measured, else bounded).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np


def service_s(args: argparse.Namespace) -> float:
    """One request's service time at a replica: tokens_per_turn * K tokens at the per-request rate."""
    per_request_rate = args.tokens_per_s_per_gpu * args.gpus_per_replica / args.batch
    return args.tokens_per_turn * args.k / per_request_rate


def cycle_s(args: argparse.Namespace) -> float:
    """One turn of an episode with nothing added: service time plus the env step's mean (lognormal)."""
    return service_s(args) + args.env_step_ms / 1000 * math.exp(args.env_step_sigma**2 / 2)


def deployment_rate(gpus: int, tokens_per_s_per_gpu: float, tokens_per_turn: int, k: int) -> float:
    """Requests/s of a deployment whose GPUs all decode at full rate: each request is K x tokens_per_turn."""
    return gpus * tokens_per_s_per_gpu / (tokens_per_turn * k)


def plan_point(args: argparse.Namespace, replicas: int, episodes: int) -> dict[str, Any]:
    """What a point of the sweep runs: E concurrent episodes (offering E / cycle requests/s) over
    ceil(E / C) env workers, iterations of `--iteration-episodes` or E / (staleness + 1) episodes, replicas
    serving up to max(B, ceil(E / replicas)) requests each."""
    iterations_open = args.staleness + 1
    episodes = max(iterations_open, episodes // iterations_open * iterations_open)
    workers = math.ceil(episodes / args.episodes_per_worker)
    capacities = [episodes // workers + (1 if i < episodes % workers else 0) for i in range(workers)]
    return {
        "replicas": replicas,
        "offered_rps": episodes / cycle_s(args),
        "episodes": episodes,
        "env_workers": workers,
        "capacities": capacities,
        "batch_size": args.iteration_episodes or episodes // iterations_open,
        "replica_batch": max(args.batch, math.ceil(episodes / replicas)),
    }


def saturation(points: list[dict[str, Any]], bound_ms: float) -> dict[str, Any]:
    """Over one replica count's points (by offered load): the knee, the first point where requests/s stops
    growing with the offered load (achieved/offered below 0.85 of the best point's ratio), the most
    requests/s measured, the most whose p99 added latency is within the bound, and the router's CPU per
    request at the point of most requests/s (all of its CPU over the window, heartbeats and episodes
    included, per request answered: at a higher rate the per-peer part spreads over more requests, so
    scaling it linearly errs on the high side)."""
    points = sorted(points, key=lambda p: p["offered_rps"])
    best_ratio = max(p["rps"] / p["offered_rps"] for p in points)
    knee = next((p for p in points if p["rps"] / p["offered_rps"] < 0.85 * best_ratio), None)
    top = max(points, key=lambda p: p["rps"])
    result: dict[str, Any] = {
        "saturated": knee is not None,
        "max_rps": top["rps"],
        "max_rps_within_p99_bound": max((p["rps"] for p in points if p["added_p99_ms"] <= bound_ms), default=0.0),
        "cpu_us_per_request": top["router_cpu_us_per_request"],
        "router_cores_at_max": top["router_cores"],
    }
    if knee is not None:
        result["knee_offered_rps"] = knee["offered_rps"]
        result["knee_rps"] = knee["rps"]
        result["router_cores_at_knee"] = knee["router_cores"]
        result["bottleneck"] = "router" if knee["router_cores"] >= 0.85 else "the simulator or the machine"
    return result


def core_calibration() -> float:
    """Seconds of a fixed pure-Python workload (loops, integer arithmetic, dict stores) on one core."""
    start = time.perf_counter()
    table: dict[int, int] = {}
    total = 0
    for i in range(1_000_000):
        total += i * i % 7
        table[i & 1023] = total
    return time.perf_counter() - start


def load_unit(args: argparse.Namespace) -> tuple[str, str]:
    """What the router's load is counted in, and the point's key for it: episodes with leases and Groups straight
    to the trainers (it sees no request then, and an episode's messages do not grow with its turns), else
    requests."""
    return ("episode", "episodes_per_s") if args.leases and not args.routed_groups else ("request", "rps")


def cpu_fit(points: list[dict[str, Any]], key: str = "rps") -> tuple[float, float] | str:
    """The router's cores against its load (`key`: requests/s or episodes/s) over `points` (one replica count,
    several loads) as a line: (fixed cores, marginal CPU seconds per unit of load), least squares; or why there
    is none: fewer than 2 distinct loads, iterations of different sizes (an iteration's costs, the weight-update
    notice to every replica among them, would grow with the rate in the deployment but not across such loads,
    and read as fixed), or a line that is not a fixed cost plus a cost per unit (a negative term: too noisy)."""
    if len({round(p[key]) for p in points}) < 2:
        return "one load"
    if len({p["batch_size"] for p in points}) > 1:
        return "loads with iterations of different sizes: --iteration-episodes"
    marginal, fixed = np.polyfit([p[key] for p in points], [p["router_cores"] for p in points], 1)
    return (float(fixed), float(marginal)) if fixed >= 0 and marginal > 0 else "a negative fixed or marginal cost"


def deployment_check(args: argparse.Namespace, points: list[dict[str, Any]], sat: dict[int, dict]) -> dict[str, Any]:
    """Whether one router keeps up with `--gpus` GPUs, at the replica count nearest the deployment's replicas and
    in the router's unit of load (`load_unit`; in episodes, the deployment's requests/s over
    `--deployment-turns`): its cores measured at a point of at least the deployment's load where there is one
    (the nearest above), else from the line through the loads (`cpu_fit`: fixed costs, heartbeats to every peer
    among them, do not grow with the load), else the load times the CPU per unit measured at the most load (an
    upper bound: the fixed costs counted per unit). Routed traffic (every request through the router) measured
    below the deployment's load gets no figure: one event loop's capacity is not a line to extend, so the check
    says where the line reaches one core (`one_core_load`), and that the router does not keep up if that is
    below the deployment's load (`router_cores` None, `keeps_up` False; None where it cannot tell)."""
    rate = deployment_rate(args.gpus, args.tokens_per_s_per_gpu, args.tokens_per_turn, args.k)
    unit, key = load_unit(args)
    turns = args.deployment_turns or args.turns
    load = rate / turns if unit == "episode" else rate
    replicas = max(1, args.gpus // args.gpus_per_replica)
    nearest = min(sat, key=lambda c: abs(math.log(c / replicas)))
    mine = [p for p in points if p["replicas"] == nearest]
    top = max(mine, key=lambda p: p[key])
    per_unit = top["router_cores"] / top[key] if top[key] else float("inf")
    fit = cpu_fit(mine, key)
    fixed, marginal = fit if isinstance(fit, tuple) else (0.0, per_unit)
    at = min((p for p in mine if p[key] >= load), key=lambda p: p[key], default=None)
    routed = unit == "request" and at is None
    one_core = (1.0 - fixed) / marginal if 0 < marginal < math.inf and fixed < 1.0 else None
    cores = at["router_cores"] if at is not None else None if routed else fixed + marginal * load
    if routed:  # (it does not keep up where the line is past one core below the load; else it cannot tell)
        keeps_up = False if one_core is not None and one_core < load else None
    else:
        keeps_up = cores < 1.0
    per_gpu = args.tokens_per_s_per_gpu / (args.tokens_per_turn * args.k) / (turns if unit == "episode" else 1)
    near_rate = [p for p in mine if p["rps"] >= 0.9 * rate]
    return {
        "gpus": args.gpus,
        "replicas": replicas,
        "measured_replicas": nearest,
        "rate_rps": rate,
        "formula": "requests/s = GPUs * tokens_per_s_per_gpu / (tokens_per_turn * K)",
        "unit": unit,
        "deployment_turns": turns,
        "load": load,
        "max_load_measured": top[key],
        "cpu_us_per_unit": per_unit * 1e6,
        "cores_per_unit_bound": per_unit * load,
        "fit_loads": len(mine) if isinstance(fit, tuple) else 0,
        "no_fit": None if isinstance(fit, tuple) else fit,
        "fixed_cores": fixed if isinstance(fit, tuple) else None,
        "marginal_us_per_unit": marginal * 1e6 if isinstance(fit, tuple) else None,
        "cores_from_line": fixed + marginal * load if isinstance(fit, tuple) else None,
        "measured_at_load": at[key] if at is not None else None,
        "router_cores": cores,
        "cores_at_max_load": top["router_cores"],
        "one_core_load": one_core,
        "cpu_target_met": cores is not None and cores <= args.cpu_target,
        "keeps_up": keeps_up,
        "margin": None if cores is None else 1.0 / cores if cores > 0 else float("inf"),
        "max_gpus_at_target": gpus_within(args.cpu_target, fixed, marginal * per_gpu),
        "max_gpus_one_core": gpus_within(1.0, fixed, marginal * per_gpu),
        "p99_at_rate_ms": min(p["added_p99_ms"] for p in near_rate) if near_rate else None,
        **_lag_at(at if at is not None else top, key),
        "message_delay": (at if at is not None else top).get("message_delay"),
        "ping_priority": (at if at is not None else top).get("ping_priority"),
        "sim_lag_p99_ms": (at if at is not None else top).get("sim_lag_p99_ms"),
        "max_rps_measured": sat[nearest]["max_rps"],
    }


def gpus_within(cores: float, fixed: float, per_gpu: float) -> int | None:
    """The most GPUs whose load fits in `cores` at `fixed` cores plus `per_gpu` cores per GPU; None with no cost
    per GPU measured (no load in the window)."""
    if not 0 < per_gpu < math.inf:
        return None
    return max(0, int((cores - fixed) / per_gpu))


def _lag_at(p: dict[str, Any], key: str) -> dict[str, Any]:
    """The router's loop lag at point `p` (None where no row of the router's fell in its window), and its load."""
    keys = (
        "router_lag_p99_bound_ms", "router_work_lag_p99_bound_ms", "router_lag_ticks", "router_lag_share_over_ms",
        "router_work_lag_share_over_ms", "router_lag_p99_ms", "router_lag_max_ms", "router_work_lag_p99_ms",
        "router_work_lag_max_ms", "router_lag_rows",
    )  # fmt: skip
    lagged = p["router_lag_rows"] > 0
    return {**{k: p[k] if lagged else None for k in keys}, "router_lag_at_load": p[key]}
