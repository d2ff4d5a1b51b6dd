"""The scale bench's report (bench/scale.py): the table of points, the saturation of each replica count, the
deployment check's lines (the router's CPU at the deployment's load, the message delay through it, its loop's
lag) and the plot.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from bench.scale_deployment import cycle_s, deployment_check, saturation, service_s
from mas_async.router.loop_lag import OVER_MS


def cpu_line(args: argparse.Namespace, check: dict[str, Any]) -> str:
    """The deployment check's line on the router's CPU at the deployment's load (for routed traffic measured
    below it: no figure, whether it keeps up)."""
    unit, load = check["unit"], check["load"]
    if check["router_cores"] is None:
        most = (
            f"the most measured: {check['max_load_measured']:.0f} {unit}s/s with {check['measured_replicas']} replicas, "
            f"at {check['cores_at_max_load']:.2f} cores"
        )
        if check["keeps_up"] is False:
            return (
                f"router CPU there: does not keep up: every request passes through the router, whose one event loop "
                f"is full at ~{check['one_core_load']:.0f} {unit}s/s by the loads measured, below the deployment's "
                f"{load:.0f} ({most}; no figure is extrapolated past one loop's capacity)"
            )
        return f"router CPU there: not measured: the deployment's {load:.0f} {unit}s/s is beyond what was ({most})"
    bound = (
        f"{check['cpu_us_per_unit']:.0f} us/{unit} at the most {unit}s/s measured ({check['max_load_measured']:.0f}) "
        f"x {load:.0f} {unit}s/s = {check['cores_per_unit_bound']:.2f} cores, the fixed costs counted per {unit}"
    )
    line = (
        f"{check['fixed_cores']:.3f} cores fixed + {check['marginal_us_per_unit']:.1f} us/{unit} (the line through "
        f"the {check['fit_loads']} loads measured with {check['measured_replicas']} replicas, up to "
        f"{check['max_load_measured']:.0f} {unit}s/s) x {load:.0f} {unit}s/s = {check['cores_from_line']:.2f} cores"
        if check["fixed_cores"] is not None
        else None
    )
    if check["measured_at_load"] is not None:
        how = (
            f"measured at {check['measured_at_load']:.0f} {unit}s/s ({check['measured_replicas']} replicas, "
            f"episodes of {args.turns} turn{'s' if args.turns != 1 else ''}): {check['router_cores']:.2f} cores"
        )
        others = f" (the line through the loads: {line})" if line else ""
    elif line is not None:
        how, others = line, f" (at most {bound})"
    else:
        how, others = f"{bound} (an upper bound: no line through the loads, {check['no_fit']})", ""
    return (
        f"router CPU there: {how}{others}; target <= {args.cpu_target:g}: "
        f"{'met' if check['cpu_target_met'] else 'NOT met'}; "
        f"{'keeps up' if check['keeps_up'] else 'does NOT keep up'} (margin {check['margin']:.2f}x of one core)"
    )


def _bound(ms: float | None) -> str:
    """A pooled percentile's bound as the table and the check print it: '<=3', or '>10' past `OVER_MS`."""
    return f"<={ms:g}" if ms is not None else f">{OVER_MS[-1]:g}"


def _lag(p: dict[str, Any]) -> str:
    """A point's router loop lag at p99 over the window's ticks, 'all/its own work' ms, or '-' with no row of
    the router's in its window."""
    if not p["router_lag_ticks"]:
        return "-"
    return f"{_bound(p['router_lag_p99_bound_ms'])}/{_bound(p['router_work_lag_p99_bound_ms'])}"


def _delay(figures: dict[str, Any], what: str) -> str:
    """'p50 a / p99 b / max c ms (n what)' of `delay_figures`, or that there was none."""
    lost = f", {figures['lost']} lost" if figures["lost"] else ""
    if not figures["n"]:
        return f"none in the window{lost}"
    return (
        f"p50 {figures['p50_ms']:.2f} / p99 {figures['p99_ms']:.2f} / max {figures['max_ms']:.2f} ms "
        f"({figures['n']} {what}{lost})"
    )


def delay_line(args: argparse.Namespace, check: dict[str, Any]) -> str:
    """The deployment check's line on what messages wait in the router at the point of the deployment's load
    (else of the most load): the ping peer's round trip, a worker's EpisodeDone to its next RunEpisode, a step's
    UpdateWeights to its last WeightsLoaded, each from when the message was due (no coordinated omission), over
    the whole window (pooled) and, for the pings, the window's worst second; judged against `--p99-bound-ms` on
    the pings and the probe worker's EpisodeDones (the simulated workers', which wait for their own loops, and the
    fan-out to every replica, one message to each, are printed beside)."""
    delay = check["message_delay"]
    ping, probe, dispatch, fanout = delay["ping"], delay["probe"], delay["dispatch"], delay["fanout"]
    met = bool(ping["n"] and probe["n"]) and max(ping["p99_ms"], probe["p99_ms"]) <= args.p99_bound_ms
    met = met and not ping["lost"]
    lag = check["sim_lag_p99_ms"]
    late = "" if lag is None or math.isnan(lag) else f", their loops {lag:.0f} ms late at p99"
    worst = ping["worst_second_p99_ms"]
    steps = f"steps, each to {check['measured_replicas']} replicas"
    return (
        f"message delay through the router (at {check['router_lag_at_load']:.0f} {check['unit']}s/s, "
        f"{check['measured_replicas']} replicas; from when each message was due): ping round trip "
        f"{_delay(ping, f'pings, one every {args.ping_ms:g} ms, the probe at {_probe(check)} priority')}"
        + ("" if math.isnan(worst) else f", the worst second's p99 {worst:.2f} ms")
        + f"; the probe worker's EpisodeDone to its next RunEpisode {_delay(probe, 'episodes, on the same loop')}"
        + f"; a step's UpdateWeights to its last WeightsLoaded {_delay(fanout, steps)}"
        f". Target <= {args.p99_bound_ms:g} ms at p99 (the pings and the probe worker's EpisodeDones): "
        f"{'met' if met else 'NOT met'}. The simulated workers' EpisodeDone to their next RunEpisode, both ends "
        f"waiting for the simulators' own loops{late}: {_delay(dispatch, 'episodes')}"
    )


def _probe(check: dict[str, Any]) -> str:
    """The ping peer's scheduling priority, as `_probe_first` set it ("unrecorded" for a point without it)."""
    return {"SCHED_FIFO": "real-time (SCHED_FIFO)", "normal": "normal"}.get(check.get("ping_priority"), "unrecorded")


def own_delay(args: argparse.Namespace, check: dict[str, Any]) -> str:
    """The deployment check's line on the router's own delay: its loop's lag at p99 over the window's ticks,
    judged against `--p99-bound-ms` on the whole lag when the router has a core of its own (`--router-core`),
    else on its own work (the rest being the simulators' CPU on the shared cores)."""
    alone = args.router_core is not None
    bound = check["router_lag_p99_bound_ms" if alone else "router_work_lag_p99_bound_ms"]
    verdict = "met" if bound is not None and bound <= args.p99_bound_ms else "NOT met"
    over = check["router_lag_share_over_ms" if alone else "router_work_lag_share_over_ms"].get(f"{args.p99_bound_ms:g}")
    share = "" if over is None else f"; {over:.2%} of the ticks over {args.p99_bound_ms:g} ms"
    where = f"on core {args.router_core} alone" if alone else "on the shared cores"
    line = (
        f"the router's own delay (at {check['router_lag_at_load']:.0f} {check['unit']}s/s, {where}): its loop ran "
        f"{_bound(check['router_lag_p99_bound_ms'])} ms late at p99 over the window's {check['router_lag_ticks']} ticks"
    )
    if alone:
        line += f" (all of it the router's own: its loop and libzmq's threads{share})"
    else:
        line += (
            f", of which its own work {_bound(check['router_work_lag_p99_bound_ms'])} ms{share} (the rest the "
            f"simulators' CPU on the shared cores)"
        )
    return (
        f"{line}; what every message it handles waits. The worst of the {check['router_lag_rows']} iteration rows: "
        f"p99 {check['router_lag_p99_ms']:.2f} ms of its own ticks, own work {check['router_work_lag_p99_ms']:.2f} ms; "
        f"at most {check['router_lag_max_ms']:.2f} ms (own work {check['router_work_lag_max_ms']:.2f} ms). Target <= "
        f"{args.p99_bound_ms:g} ms at p99{'' if alone else ', its own work'}: {verdict}"
        + (" (with leases no request passes through the router)" if args.leases else "")
    )


def groups_note(p: dict[str, Any]) -> str:
    """With leases: where the point's Groups went over the run, what the trainer made of the straight ones, and
    the router's CPU per episode done in the window."""
    note = f"  groups: {p['groups_via_router']} via the router, {p['groups_straight']} straight"
    if p["groups_straight"] or p["groups_accepted"]:
        note += f" ({p['groups_delivered']} of {p['groups_accepted']} accepted delivered)"
    problems = [f"{p[f'groups_{key}']} {key}" for key in ("missing", "unaccepted", "refused") if p[f"groups_{key}"]]
    if problems:
        note += f" ({', '.join(problems)})"
    if p["episodes_per_s"]:
        note += f"; router {p['router_cpu_us_per_episode']:.0f} us/episode"
    return note


def report(args: argparse.Namespace, points: list[dict[str, Any]], calibration_s: float) -> dict[str, Any]:
    leases = (
        "off: Generate and Groups through the router"
        if not args.leases
        else "on: Generate straight to the replicas, Groups "
        + ("through the router (--routed-groups)" if args.routed_groups else "straight to the trainer")
    )
    print(
        f"scale: K={args.k}, prompt {args.prompt_tokens} tokens, {args.tokens_per_turn} tokens/turn, {args.turns} turns, "
        f"env step lognormal median {args.env_step_ms:g} ms sigma {args.env_step_sigma:g}; service "
        f"{service_s(args) * 1000:.0f} ms/request (B={args.batch}, {args.tokens_per_s_per_gpu:g} tokens/s/GPU); cycle "
        f"{cycle_s(args) * 1000:.0f} ms; staleness {args.staleness}; CURVE {'on' if args.curve else 'off'}; "
        f"leases {leases}; heartbeats every {args.heartbeat_s:g} s or processes / 500 s where longer; "
        f"{args.procs} simulator processes and a ping peer (every {args.ping_ms:g} ms); router: TensorBoard "
        f"{'on' if args.tensorboard else 'off'}, logging at {args.log_level}; window {args.seconds:g} s after "
        f"{args.warmup:g} s" + ("" if args.router_core is None else f"; the router alone on core {args.router_core}")
    )
    head = (
        f"{'replicas':>8} {'offered':>8} {'episodes':>8} {'req/s':>8} {'us/req':>7} {'loop us':>7} {'router':>6} {'sims':>5} "
        f"{'p50 ms':>7} {'p99 ms':>7} {'transit':>7} {'RSS MB':>7} {'samples/s':>9} {'lag p99':>7} {'router lag':>10} "
        f"{'ping p99':>8}"
    )
    print(head)
    for p in points:
        print(
            f"{p['replicas']:>8} {p['offered_rps']:>8.0f} {p['episodes']:>8} {p['rps']:>8.0f} "
            f"{p['router_cpu_us_per_request']:>7.1f} {p['router_main_us_per_request']:>7.1f} {p['router_cores']:>6.2f} "
            f"{p['sim_cores']:>5.2f} "
            f"{p['added_p50_ms']:>7.2f} {p['added_p99_ms']:>7.2f} {p['in_transit']:>7.1f} {p['router_rss_mb']:>7.0f} "
            f"{p['samples_per_s']:>9.0f} {p['sim_lag_p99_ms']:>7.2f} {_lag(p):>10} "
            f"{p['message_delay']['ping']['p99_ms']:>8.2f}"
            + (f"  {p['direct_fraction']:.0%} straight" if p["direct_fraction"] < 1 and args.leases else "")
            + (f"  errors {p['errors']}" if p["errors"] else "")
            + (f"  sample mismatches {p['sample_mismatches']}" if p["sample_mismatches"] else "")
            + (groups_note(p) if args.leases else "")
            + (f"  router warnings {len(p['router_warnings'])}" if p["router_warnings"] else "")
        )
    print(
        "(us/req: the router process's CPU per request; loop us: its main thread's, the rest being libzmq's I/O "
        "threads (CURVE, TCP); router: its cores over the window; sims: the simulators' cores; p50/p99: latency added per request, "
        "end-to-end minus the replica's service time, the simulators' loop lag included; transit: requests "
        "in transit, Little's law; lag p99: the simulators' loop lag; router lag: how late the router's "
        "loop ran, what every message waits before the router handles it, p99 over the window's ticks (a bound: "
        "router/loop_lag.py's OVER_MS): all / the router's own work; ping p99: the ping peer's round trip through the "
        "router, p99 from when each ping was due)"
    )
    sat: dict[int, dict[str, Any]] = {}
    for count in sorted({p["replicas"] for p in points}):
        sat[count] = s = saturation([p for p in points if p["replicas"] == count], args.p99_bound_ms)
        knee = (
            f"requests/s stops growing at offered {s['knee_offered_rps']:.0f} (achieved {s['knee_rps']:.0f}, the "
            f"router at {s['router_cores_at_knee']:.2f} cores: bound by {s['bottleneck']})"
            if s["saturated"]
            else "requests/s grew with every offered load"
        )
        print(
            f"{count} replicas: {knee}; the most measured: {s['max_rps']:.0f} req/s (router {s['cpu_us_per_request']:.0f}"
            f" us/request, {s['router_cores_at_max']:.2f} cores); the most within p99 <= {args.p99_bound_ms:g} ms: "
            f"{s['max_rps_within_p99_bound']:.0f} req/s"
        )
    check = deployment_check(args, points, sat)
    print(
        f"deployment: {args.gpus} GPUs x {args.tokens_per_s_per_gpu:g} tokens/s / ({args.tokens_per_turn} tokens/turn "
        f"x K={args.k}) = {check['rate_rps']:.0f} requests/s ({check['formula']})"
    )
    if check["unit"] == "episode":
        print(
            f"  with leases and Groups straight to the trainers the router sees episodes, not requests: "
            f"{check['rate_rps']:.0f} requests/s in episodes of {check['deployment_turns']} turns are "
            f"{check['load']:.0f} episodes/s"
        )
    print("  " + cpu_line(args, check))
    print(delay_line(args, check))
    print(
        f"  one core here is taken as one server core (this machine: {calibration_s * 1000:.0f} ms for the fixed "
        f"pure-Python workload, `core_calibration`)"
    )
    if check["p99_at_rate_ms"] is not None:
        verdict = "met" if check["p99_at_rate_ms"] <= args.p99_bound_ms else "NOT met"
        print(f"  p99 added latency at that rate: {check['p99_at_rate_ms']:.2f} ms (target <= "
              f"{args.p99_bound_ms:g} ms: {verdict})")  # fmt: skip
    else:
        print(
            f"  p99 added latency at that rate: not measured here (the most requests/s reached with "
            f"{check['measured_replicas']} replicas: {check['max_rps_measured']:.0f})"
        )
    if check["router_lag_ticks"]:
        print("  " + own_delay(args, check))
    print(
        f"  largest deployment of one router ({args.tokens_per_s_per_gpu:g} tokens/s/GPU, {args.tokens_per_turn} "
        f"tokens/turn, K={args.k}"
        + (f", {check['deployment_turns']} turns an episode" if check["unit"] == "episode" else "")
        + (
            f"): {check['max_gpus_at_target']} GPUs at <= {args.cpu_target:g} core, {check['max_gpus_one_core']} GPUs "
            f"at one full core"
            if check["max_gpus_one_core"] is not None
            else "): not measured (no load in the window)"
        )
    )
    return {"saturation": {str(k): v for k, v in sat.items()}, "deployment": check}


def plot(points: list[dict[str, Any]], path: Path, bound_ms: float, cpu_target: float, alone: bool = False) -> None:
    """Requests/s, the end-to-end added p99, the router's loop lag p99 (with `alone`, the router on a core of its
    own: all of it; else the part that was its own work) and its cores, against the offered load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    for count in sorted({p["replicas"] for p in points}):
        mine = sorted((p for p in points if p["replicas"] == count), key=lambda p: p["offered_rps"])
        x = [p["offered_rps"] for p in mine]
        label = f"{count} replicas"
        axes[0].plot(x, [p["rps"] for p in mine], "o-", label=label)
        axes[1].plot(x, [p["added_p99_ms"] for p in mine], "o-", label=label)
        key = "router_lag_p99_bound_ms" if alone else "router_work_lag_p99_bound_ms"
        ceiling = OVER_MS[-1] * 1.05  # (a p99 past the largest of OVER_MS is drawn at the top of the panel)
        lag = [(ceiling if p[key] is None else p[key]) if p["router_lag_ticks"] else math.nan for p in mine]
        axes[2].plot(x, lag, "o-", label=label)
        axes[3].plot(x, [p["router_cores"] for p in mine], "o-", label=label)
    top = max(p["offered_rps"] for p in points)
    axes[0].plot([0, top], [0, top], ":", color="grey", label="offered")
    for ax in axes[1:3]:
        ax.axhline(bound_ms, ls="--", color="red", label=f"{bound_ms:g} ms bound")
    axes[3].axhline(cpu_target, ls="--", color="red", label=f"{cpu_target:g} core target")
    titles = (
        "requests/s",
        "added latency p99, end to end (ms)",
        "router's loop lag p99 (ms, at most)" if alone else "router's loop lag p99, its own work (ms, at most)",
        "router CPU (cores)",
    )
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xlabel("offered load (requests/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[2].set_ylim(0, max(bound_ms, OVER_MS[-1]) * 1.1)
    axes[1].set_yscale("log")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
