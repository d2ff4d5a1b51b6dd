"""The scale bench's deployment check (bench/scale_deployment.py, bench/scale_report.py): the router's load is
counted in episodes with leases (in requests without), its CPU at the deployment's load is measured at a point of
at least that load, else read from the line through several loads (fixed costs plus a cost per episode), else
bounded from the most load, and routed traffic measured below that load gets no figure (whether one event loop keeps
up); its own delay is judged on the p99 over all the window's ticks."""

from __future__ import annotations

import math

import pytest

from bench.scale import parse_args
from bench.scale_deployment import cpu_fit, deployment_check
from bench.scale_report import cpu_line, delay_line, own_delay
from bench.scale_sweep import router_lag
from mas_async.metrics import Keys
from mas_async.router.loop_lag import OVER_MS

RATE = 1024 * 3000 / (100 * 4)  # the default deployment: 7,680 requests/s
EPISODES = RATE / 4  # in episodes of 4 turns: 1,920 a second
SAT = {1024: {"max_rps": 3000.0}}


def point(episodes_per_s: float, cores: float, batch: int = 2048, turns: int = 4) -> dict:
    """A measured point of 1,024 replicas: its episodes/s (of `turns` requests each), the router's cores, its
    iterations' episodes."""
    return {"replicas": 1024, "episodes_per_s": episodes_per_s, "rps": episodes_per_s * turns, "router_cores": cores,
            "batch_size": batch, "router_lag_rows": 0, "added_p99_ms": 1.0}  # fmt: skip


def test_with_leases_the_load_is_in_episodes_and_the_cpu_at_it_is_the_fixed_cost_plus_the_marginal_one():
    points = [point(250, 0.12), point(500, 0.14), point(750, 0.16)]  # 0.1 cores fixed + 80 us/episode
    fixed, marginal = cpu_fit(points, "episodes_per_s")  # (one iteration size at every load)
    assert math.isclose(fixed, 0.1, rel_tol=1e-9) and math.isclose(marginal, 80e-6, rel_tol=1e-9)
    check = deployment_check(parse_args([]), points, SAT)
    assert check["unit"] == "episode" and check["load"] == EPISODES and check["measured_at_load"] is None
    assert math.isclose(check["router_cores"], 0.1 + 80e-6 * EPISODES)  # 0.25 cores
    assert math.isclose(
        check["cores_per_unit_bound"], 0.16 / 750 * EPISODES
    )  # 0.41: the fixed part counted per episode
    assert check["fit_loads"] == 3 and check["cpu_target_met"]
    # GPUs at 0.5 core: (0.5 - 0.1) / (80 us x 7.5 requests/s per GPU / 4 turns)
    assert check["max_gpus_at_target"] == int(0.4 / (80e-6 * 7.5 / 4))
    assert "0.100 cores fixed + 80.0 us/episode" in cpu_line(parse_args([]), check)
    # In episodes of 8 turns the same GPUs send half as many episodes.
    assert deployment_check(parse_args(["--deployment-turns", "8"]), points, SAT)["load"] == RATE / 8


def test_a_point_at_the_deployments_load_or_above_is_the_measurement_the_check_takes():
    """The nearest above: 1,950 episodes/s at 0.39 cores, not the line, nor the point of 2,100 (the short
    episodes of `--turns 1` reach the load of 4-turn ones)."""
    points = [point(1800, 0.30, turns=1), point(2100, 0.33, turns=1), point(1950, 0.39, turns=1)]
    args = parse_args(["--turns", "1", "--deployment-turns", "4"])
    check = deployment_check(args, points, SAT)
    assert check["load"] == EPISODES and check["measured_at_load"] == 1950 and check["router_cores"] == 0.39
    assert check["cores_from_line"] is not None and check["cores_from_line"] != 0.39
    assert "measured at 1950 episodes/s (1024 replicas, episodes of 1 turn): 0.39 cores" in cpu_line(args, check)
    assert deployment_check(args, [point(1919, 0.3, turns=1)], SAT)["measured_at_load"] is None  # below: none


def test_a_window_with_no_load_gives_no_deployment_size():
    check = deployment_check(parse_args([]), [point(0, 0.1)], SAT)
    assert check["max_gpus_at_target"] is None and check["max_gpus_one_core"] is None and not check["keeps_up"]


def test_without_leases_the_load_is_in_requests_and_routed_traffic_below_it_gets_no_figure():
    points = [point(250, 0.25), point(750, 0.65)]  # 1,000 and 3,000 requests/s: 0.05 cores + 200 us/request
    args = parse_args(["--no-leases"])
    check = deployment_check(args, points, SAT)
    assert check["unit"] == "request" and check["load"] == RATE
    # One event loop is full at 4,750 requests/s by the line, below the deployment's 7,680: it does not keep up,
    # and no cores figure is extrapolated past one loop's capacity.
    assert check["router_cores"] is None and check["keeps_up"] is False and not check["cpu_target_met"]
    assert math.isclose(check["one_core_load"], 0.95 / 200e-6)
    line = cpu_line(args, check)
    assert line.startswith("router CPU there: does not keep up") and "~4750 requests/s" in line
    assert "cores fixed" not in line and "1.59" not in line  # (the line's 1.59 cores at the load: not a figure)
    assert deployment_check(parse_args(["--routed-groups"]), points, SAT)["unit"] == "request"
    # A line that stays under one core past the load: not measured there, no verdict either way.
    cheap = deployment_check(args, [point(250, 0.02), point(750, 0.06)], SAT)
    assert cheap["router_cores"] is None and cheap["keeps_up"] is None
    assert cpu_line(args, cheap).startswith("router CPU there: not measured")
    # Measured at the load (8,000 requests/s): the figure is the measurement.
    at = deployment_check(args, [*points, point(2000, 0.9)], SAT)
    assert at["router_cores"] == 0.9 and at["keeps_up"] and at["measured_at_load"] == 8000


@pytest.mark.parametrize(
    ("points", "why"),
    [
        ([point(750, 0.16)], "one load"),
        ([point(750, 0.16), point(750.2, 0.17)], "one load"),  # measured twice
        ([point(250, 0.20), point(750, 0.16)], "negative"),  # less CPU for more episodes: noise, not a line
        ([point(250, 0.01), point(500, 0.2)], "negative"),  # a negative fixed cost: noise
        # Iterations of half of each load's episodes: as many iterations a second at every load, so their cost
        # (a notice to every replica) would read as fixed, where the deployment's grows with its rate.
        ([point(250, 0.12, batch=512), point(750, 0.16, batch=2048)], "iterations of different sizes"),
    ],
)
def test_without_a_line_of_a_fixed_and_a_marginal_cost_the_check_counts_every_cost_per_episode(points, why):
    assert why in cpu_fit(points, "episodes_per_s")
    check = deployment_check(parse_args([]), points, SAT)
    assert check["fixed_cores"] is None and check["fit_loads"] == 0 and why in check["no_fit"]
    top = max(points, key=lambda p: p["episodes_per_s"])  # its CPU per episode, times the deployment's episodes/s
    assert math.isclose(check["router_cores"], top["router_cores"] / top["episodes_per_s"] * EPISODES)
    assert "an upper bound: no line through the loads" in cpu_line(parse_args([]), check)


def lag_row(ticks: int, over: dict[float, int], p99: float, most: float) -> dict:
    counts = {Keys.loop_lag_over(ms): over.get(ms, 0) for ms in OVER_MS}
    return {
        "router/loop_lag_p50_ms": 0.2, "router/loop_lag_p99_ms": p99, "router/loop_lag_max_ms": most,
        "router/loop_work_lag_p99_ms": p99, "router/loop_work_lag_max_ms": most, Keys.LOOP_LAG_TICKS: ticks,
        **counts, **{Keys.loop_lag_over(ms, work=True): over.get(ms, 0) for ms in OVER_MS},
    }  # fmt: skip


def test_the_own_delay_is_judged_on_the_windows_ticks_and_the_worst_rows_figures_are_shown_beside():
    # A row of 230 ticks with 1 over 4 ms, and a row of 22 whose worst tick (7.5 ms) is its own p99: of the
    # 252, 3 ran over 2 ms (over 1%) and 2 over 3 ms.
    rows = [
        lag_row(230, {1: 4, 2: 2, 3: 1, 4: 1}, 2.1, 4.5),
        lag_row(22, dict.fromkeys((1, 2, 3, 4, 5, 6), 1), 7.2, 7.5),
    ]
    figures = router_lag(rows)
    assert figures["router_lag_ticks"] == 252 and figures["router_lag_p99_bound_ms"] == 3.0
    assert figures["router_lag_share_over_ms"]["5"] == 1 / 252 and figures["router_lag_p99_ms"] == 7.2
    args = parse_args(["--router-core", "0"])
    line = own_delay(args, {**figures, "router_lag_at_load": 1950.0, "unit": "episode"})
    assert "<=3 ms late at p99 over the window's 252 ticks" in line and "0.40% of the ticks over 5 ms" in line
    assert line.endswith("Target <= 5 ms at p99: met (with leases no request passes through the router)")
    assert "p99 7.20 ms of its own ticks" in line and "at most 7.50 ms" in line
    late = router_lag([lag_row(100, dict.fromkeys(OVER_MS[:-1], 2), 9.0, 9.5)])  # 2% over 8 ms
    assert late["router_lag_p99_bound_ms"] == 10.0
    assert own_delay(args, {**late, "router_lag_at_load": 1950.0, "unit": "episode"}).endswith("Target <= 5 ms at p99: NOT met (with "
                                                                           "leases no request passes through the router)")  # fmt: skip
    shared = own_delay(parse_args([]), {**late, "router_lag_at_load": 1950.0, "unit": "episode"})
    assert "of which its own work <=10 ms" in shared and "at p99, its own work: NOT met" in shared


def test_message_delays_count_from_when_each_message_was_due_within_the_window():
    """Pings by their place in the pace (a ping due at 0.50 s and answered at 0.58 s waited 80 ms, however late it
    went), one unanswered lost; EpisodeDone to RunEpisode only where the router had work to give, the probe worker's
    apart from the simulated workers'; a step's fan-out
    to its last WeightsLoaded only where every replica took it; nothing due outside the window."""
    from bench.scale_sweep import message_delays

    pings = [(0.1 * i, 0.1 * i + 0.002) for i in range(1, 10)] + [(0.5, 0.58), (0.95, None), (2.5, 2.6)]
    reports = {
        0: {"dispatches": [(0.2, 0.203, True), (0.3, 0.9, False), (1.5, 1.6, True)],
            "updates": [(1, 0.4), (2, 0.8), (3, 1.9)], "loaded": [(1, 0.41), (2, 0.82), (3, 1.95)]},
        1: {"dispatches": [(0.6, 0.61, True)], "updates": [], "loaded": [(1, 0.43)]},
    }  # fmt: skip
    probe = [(0.25, 0.251, True), (0.7, 0.704, True), (0.8, 1.3, False), (1.2, 1.201, True)]
    delays = message_delays(reports, pings, t0=0.0, t1=1.0, replicas=2, probe=probe)
    ping = delays["ping"]
    assert ping["n"] == 10 and ping["lost"] == 1 and math.isclose(ping["max_ms"], 80.0)
    assert math.isclose(ping["p50_ms"], 2.0)
    dispatch = delays["dispatch"]  # (the wait for a step, 600 ms, is not the router's; 1.5 s is after the window)
    assert dispatch["n"] == 2 and math.isclose(dispatch["max_ms"], 10.0) and math.isclose(dispatch["p50_ms"], 6.5)
    probe = delays["probe"]  # the probe worker's alone, by the same rule (not pooled with the simulated workers')
    assert probe["n"] == 2 and math.isclose(probe["max_ms"], 4.0) and math.isclose(probe["p50_ms"], 2.5)
    fanout = delays["fanout"]  # version 2 reached one replica of the two: lost; version 3 is after the window
    assert fanout["n"] == 1 and fanout["lost"] == 1 and math.isclose(fanout["max_ms"], 30.0)


def test_the_message_delay_is_judged_on_the_pings_and_the_probe_worker_not_on_the_simulated_workers():
    """The verdict reads the pings' and the probe worker's p99 (on an idle loop: the router's delay); the simulated
    workers' EpisodeDones, which wait for their own saturated loops, are printed beside it, with those loops' lag."""

    def figures(p99: float, n: int = 100, lost: int = 0) -> dict:
        return {"n": n, "p50_ms": p99 / 4, "p99_ms": p99, "max_ms": 2 * p99, "lost": lost}

    def line(ping: dict, probe: dict, dispatch: dict) -> str:
        delay = {"ping": {**ping, "worst_second_p99_ms": 6.0}, "probe": probe, "dispatch": dispatch,
                 "fanout": figures(60.0, n=5)}  # fmt: skip
        check = {"message_delay": delay, "router_lag_at_load": 2000.0, "unit": "episode", "measured_replicas": 1024,
                 "ping_priority": "SCHED_FIFO", "sim_lag_p99_ms": 90.0}  # fmt: skip
        return delay_line(parse_args([]), check)

    met = line(figures(4.0), figures(4.5), figures(230.0))
    assert "the probe worker's EpisodeDone to its next RunEpisode p50 1.12 / p99 4.50" in met
    assert "(the pings and the probe worker's EpisodeDones): met." in met
    assert met.endswith("their loops 90 ms late at p99: p50 57.50 / p99 230.00 / max 460.00 ms (100 episodes)")
    assert ": NOT met." in line(figures(4.0), figures(5.5), figures(3.0))  # the probe over the bound
    assert ": NOT met." in line(figures(5.5), figures(4.0), figures(3.0))  # the pings over it
    assert ": NOT met." in line(figures(4.0), figures(0.0, n=0), figures(3.0))  # the probe ran no episode
    assert ": NOT met." in line(figures(4.0, lost=1), figures(4.0), figures(3.0))  # a ping never answered
