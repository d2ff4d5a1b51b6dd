"""The scale bench's load sweep (bench/scale.py): one point of it, the real router process against the simulated
peers (`bench/scale_peers.py`), measured over a window after a warm-up, and the point's figures.

A point is (replicas, concurrent episodes); `measure_point` starts the router as its own process, the
simulators and the ping peer, waits for every peer's Welcome, measures the router's CPU, its loop lag (its
metrics rows) and what the simulators recorded over the window, and tears everything down by pid.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.scale_deployment import plan_point, service_s
from bench.scale_peers import (
    GROUP_COUNTS,
    JOIN_TIMEOUT_S,
    POLICY,
    TRAINER,
    env_name,
    ping_process,
    replica_name,
    sim_process,
)
from mas_async.metrics import Keys as MetricKeys
from mas_async.router.loop_lag import OVER_MS, pooled_percentile

ROOT = Path(__file__).resolve().parents[1]


Keys = tuple[str, dict[str, str]] | None


def start_router(args: argparse.Namespace, run_dir: Path, plan: dict[str, Any]) -> tuple[str, Keys, subprocess.Popen]:
    """The real router as its own process, configured for the point's peers; returns its endpoint, the run's
    keys (the folder and every process's secret key; None without CURVE) and the process."""
    from mas_async.config import dump_config, load_config
    from mas_async.deployment import Deployment, free_ports
    from mas_async.runtime.curve import SECRET_ENV, issued_secret, prepare_keys

    overrides = [
        f"run.output_dir={run_dir}",
        "run.iterations=1000000",
        "eval.every=0",
        "env.train_size=64",
        "env.test_size=1",
        f"algorithm.k={args.k}",
        f"rollout.batch_size={plan['batch_size']}",
        f"rollout.max_staleness={args.staleness}",
        f"rollout.episodes_per_worker={args.episodes_per_worker}",
        f"rollout.max_tokens={args.tokens_per_turn}",
        "rollout.episode_timeout_s=600",
        f"cluster.env_workers={plan['env_workers'] + 1}",  # (the last one: the ping peer)
        f"policies.{POLICY}.replicas={plan['replicas']}",
        "cluster.peer_timeout_s=120",
        f"cluster.heartbeat_s={args.heartbeat_s}",
        f"cluster.curve={str(args.curve).lower()}",
        f"cluster.leases={str(args.leases).lower()}",
        "trainer.checkpoint_every=0",
        f"metrics.tensorboard={str(args.tensorboard).lower()}",
    ]
    config = load_config(ROOT / "configs" / "plan_path_tiny_shared.yaml", overrides)
    plan["heartbeat_s"] = config.heartbeat_interval_s()  # the simulated peers' interval, as the real ones'
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    dump_config(config, run_dir / "config.yaml")
    endpoint = f"tcp://127.0.0.1:{free_ports('127.0.0.1', 1)[0]}"
    names = [TRAINER, *map(replica_name, range(plan["replicas"])), *map(env_name, range(plan["env_workers"] + 1))]
    keys_dir = prepare_keys(config, run_dir, names)
    keys = None if keys_dir is None else (keys_dir, {name: issued_secret(keys_dir, name) for name in names})
    Deployment(endpoint, {POLICY: 0}, {POLICY: ""}, keys_dir=keys_dir).save(run_dir / "deployment.json")
    secret = {} if keys_dir is None else {SECRET_ENV: issued_secret(keys_dir, "router")}
    profile = ["-m", "cProfile", "-o", str(args.profile)] if args.profile else []
    with (run_dir / "logs" / "router.log").open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, *profile, "-m", "mas_async.launch.process", "router", str(run_dir)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "MAS_ASYNC_LOG_LEVEL": args.log_level, **secret},
        )
    return endpoint, keys, proc


def _pin(core: int, router: Any, others: list[Any]) -> None:
    """Every thread of the router on `core`, every thread of `others` (the simulators) on the other cores: the
    router's loop then waits for its own work only (threads made later inherit it)."""
    rest = os.sched_getaffinity(0) - {core}
    if core not in os.sched_getaffinity(0) or not rest:
        raise SystemExit(f"--router-core {core}: this process may run on cores {sorted(os.sched_getaffinity(0))}; "
                         "the router needs one of them and the simulators at least one other")  # fmt: skip
    for proc, cores in [(router, {core}), *((other, rest) for other in others)]:
        for thread in proc.threads():
            os.sched_setaffinity(thread.id, cores)


def _probe_first(probe: Any) -> str:
    """The ping peer's threads at real-time priority (SCHED_FIFO 1; root only): woken by the router's answer, it
    runs at once even on the simulators' saturated cores, so its round trip is the router's and the network's, not
    its own wait for a core. It sends one small message every `--ping-ms`. Returns "SCHED_FIFO", or "normal"
    where this user may not (the round trip then includes that wait): what the threads have, read back."""
    threads = [thread.id for thread in probe.threads()]
    try:
        for tid in threads:
            os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(1))
    except PermissionError:
        pass
    return "SCHED_FIFO" if all(os.sched_getscheduler(tid) == os.SCHED_FIFO for tid in threads) else "normal"


def _cores_of(proc: Any) -> list[int]:
    """The cores any thread of `proc` may run on."""
    cores: set[int] = set()
    for thread in proc.threads():
        try:
            cores |= os.sched_getaffinity(thread.id)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    return sorted(cores)


def _cpu(proc: Any) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def _main_thread_cpu(proc: Any) -> float:
    """CPU seconds of the process's main thread (the router's event loop; the others are libzmq's I/O
    threads, where CURVE encrypts and the sockets' TCP work happens)."""
    return next((t.user_time + t.system_time for t in proc.threads() if t.id == proc.pid), float("nan"))


def _percentile(values: list[float] | np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def measure_point(args: argparse.Namespace, replicas: int, episodes: int, run_dir: Path) -> dict[str, Any]:
    """Run one point: start the router and the simulators, measure over the window, tear everything down."""
    import psutil

    plan = plan_point(args, replicas, episodes)
    spawn = mp.get_context("spawn")
    out, stop = spawn.Queue(), spawn.Event()
    endpoint, keys, router = start_router(args, run_dir, plan)
    _wait_bound(endpoint, router, run_dir)  # (before the replicas bind ports of their own: none may take its port)
    sims: list[Any] = []
    reports: dict[int, dict[str, Any]] = {}
    try:
        workers = list(enumerate(plan["capacities"]))  # (the last one is the probe worker, beside the ping peer)
        procs = min(args.procs, replicas + len(workers) - 1)
        common = {
            "endpoint": endpoint,
            "keys": keys,
            "out": out,
            "k": args.k,
            "prompt_tokens": args.prompt_tokens,
            "tokens_per_turn": args.tokens_per_turn,
            "turns": args.turns,
            "env_step_mu": math.log(args.env_step_ms / 1000),
            "env_step_sigma": args.env_step_sigma,
            "samples": args.turns * args.k,
            "sample_tokens": args.turns * args.k * (args.prompt_tokens + args.tokens_per_turn),
            "service_s": service_s(args),
            "replica_batch": plan["replica_batch"],
            "step_s": args.step_ms / 1000,
            "heartbeat_s": plan["heartbeat_s"],
            "leases": args.leases,
            "direct_groups": args.leases and not args.routed_groups,
            "max_s": args.warmup + args.seconds + JOIN_TIMEOUT_S + 60,
        }
        for index in range(procs):
            spec = {
                **common,
                "index": index,
                "trainer": index == 0,
                "replicas": list(range(index, replicas, procs)),
                "env_workers": workers[:-1][index::procs],
            }
            sims.append(spawn.Process(target=sim_process, args=(spec, stop), daemon=True))
        probe = {**common, "index": procs, "trainer": False, "replicas": [],
                 "env_workers": workers[-1:]}  # fmt: skip
        ping = {"endpoint": endpoint, "keys": keys, "out": out, "index": procs, "name": env_name(plan["env_workers"]),
                "ping_s": args.ping_ms / 1000, "max_s": common["max_s"], "probe": probe}  # fmt: skip
        sims.append(spawn.Process(target=ping_process, args=(ping, stop), daemon=True))  # (taken as a simulator)
        for sim in sims:
            sim.start()

        def take(kind: str, deadline: float) -> dict[int, Any]:
            got: dict[int, Any] = {}
            while len(got) < len(sims):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited past the bound for the simulators' {kind!r} ({len(got)}/{len(sims)})")
                if router.poll() is not None:
                    raise RuntimeError(f"the router exited ({router.returncode}):\n{_log_tail(run_dir)}")
                try:
                    what, index, value = out.get(timeout=0.5)
                except queue.Empty:
                    if any(not s.is_alive() and s.exitcode for s in sims):
                        raise RuntimeError("a simulator process died") from None
                    continue
                if what == "failed":
                    raise RuntimeError(f"simulator {index} failed: {value}\n{_log_tail(run_dir)}")
                if what == kind:
                    got[index] = value
            return got

        take("ready", time.monotonic() + JOIN_TIMEOUT_S)
        router_ps = psutil.Process(router.pid)
        sim_ps = [psutil.Process(s.pid) for s in sims]
        if args.router_core is not None:
            _pin(args.router_core, router_ps, sim_ps)  # (this process sleeps through the window)
        probe_priority = _probe_first(sim_ps[-1]) if args.ping_priority == "real-time" else "normal"
        time.sleep(args.warmup)
        t0, cpu0, sim_cpu0 = time.perf_counter(), _cpu(router_ps), sum(map(_cpu, sim_ps))
        main0, rows0 = _main_thread_cpu(router_ps), len(_router_rows(run_dir))
        while time.perf_counter() < t0 + args.seconds:
            if router.poll() is not None:
                raise RuntimeError(f"the router exited ({router.returncode}):\n{_log_tail(run_dir)}")
            time.sleep(min(0.2, max(0.0, t0 + args.seconds - time.perf_counter())))
        t1, cpu1, sim_cpu1 = time.perf_counter(), _cpu(router_ps), sum(map(_cpu, sim_ps))
        main1 = _main_thread_cpu(router_ps)
        rows = _router_rows(run_dir)[rows0:]  # the iterations whose row the router wrote in the window
        rss = router_ps.memory_info().rss
        router_on = _cores_of(router_ps)
        warnings = _log_warnings(run_dir)  # (until the window's end: the teardown's are not the run's)
        stop.set()
        reports = take("report", time.monotonic() + JOIN_TIMEOUT_S)
    finally:
        stop.set()
        for sim in sims:
            sim.join(timeout=5)
            if sim.is_alive():
                sim.kill()
                sim.join(timeout=5)
        if router.poll() is None and args.profile:  # (SIGTERM: the router stops, and cProfile writes)
            router.terminate()
            try:
                router.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        if router.poll() is None:
            router.kill()
        router.wait(timeout=10)
    ping = reports.pop(procs)
    probe = ping["probe"]  # its requests, samples and episodes count with the simulators'; its own loop's lag does not
    figures = _figures(
        args, plan, {**reports, procs: {**probe, "lag": [], "queued": [], "dispatches": []}}, t0, t1,
        (cpu1 - cpu0, main1 - main0), sim_cpu1 - sim_cpu0, rss,
    )  # fmt: skip
    figures["message_delay"] = message_delays(reports, ping["pings"], t0, t1, replicas, probe["dispatches"])
    figures["router_warnings"] = warnings
    figures["router_on_cores"] = router_on
    figures["ping_priority"] = probe_priority
    figures.update(router_lag(rows))
    return figures


def delay_figures(delays_s: list[float], lost: int = 0) -> dict[str, Any]:
    """p50, p99 and max in ms of `delays_s` (NaN with none), their count, and how many never came (`lost`)."""
    ms = np.array(delays_s) * 1000
    return {"n": len(ms), "p50_ms": _percentile(ms, 50), "p99_ms": _percentile(ms, 99),
            "max_ms": float(ms.max()) if len(ms) else float("nan"), "lost": lost}  # fmt: skip


def _refills(dispatches: list[tuple[float, float, bool]], t0: float, t1: float) -> list[float]:
    """EpisodeDone to next RunEpisode of `dispatches` (`SimEnvWorker.dispatched`) due in [t0, t1), where the router
    had work to give."""
    return [got - due for due, got, router in dispatches if router and t0 <= due < t1]


def message_delays(
    reports: dict[int, dict[str, Any]],
    pings: list[tuple[float, float | None]],
    t0: float,
    t1: float,
    replicas: int,
    probe: list[tuple[float, float, bool]],
) -> dict[str, Any]:
    """What messages waited in the router, over the window [t0, t1) (by when each was due):

    - ping: the ping peer's round trip, from each ping's place in its pace (`ping_process`); one unanswered is
      lost; `worst_second_p99_ms`: the p99 of the window's worst second;
    - dispatch: a simulated worker's EpisodeDone (when it was due: its last env step's end, or its trainer's
      answer) to its next RunEpisode, where the router had work to give (`SimEnvWorker.dispatched`; both ends
      wait for the simulator's loop too);
    - probe: the same of the probe worker (`probe`, its dispatches), on the ping peer's idle loop: the router's;
    - fanout: the trainer's UpdateWeights (when its step ended) to the last of the replicas taking it and
      answering WeightsLoaded (`lost`: steps some replica never heard of)."""
    rtt = [(due, answered - due) for due, answered in pings if t0 <= due < t1 and answered is not None]
    lost = sum(1 for due, answered in pings if t0 <= due < t1 and answered is None)
    seconds = {}
    for due, delay in rtt:
        seconds.setdefault(int(due - t0), []).append(delay)
    worst = max((_percentile(np.array(d) * 1000, 99) for d in seconds.values() if len(d) >= 10), default=float("nan"))
    dispatch = [delay for r in reports.values() for delay in _refills(r["dispatches"], t0, t1)]
    loaded: dict[int, list[float]] = {}
    for r in reports.values():
        for version, at in r["loaded"]:
            loaded.setdefault(version, []).append(at)
    updates = [(v, due) for r in reports.values() for v, due in r["updates"] if t0 <= due < t1]
    fanout = [max(loaded[v]) - due for v, due in updates if len(loaded.get(v, ())) == replicas]
    return {
        "ping": {**delay_figures([d for _, d in rtt], lost), "worst_second_p99_ms": worst},
        "dispatch": delay_figures(dispatch),
        "probe": delay_figures(_refills(probe, t0, t1)),
        "fanout": delay_figures(fanout, len(updates) - len(fanout)),
    }


def _router_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The router's metrics rows so far (one per iteration), the last line left out if not yet whole."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def router_lag(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """How late the router's own loop ran (router/loop_lag.py) in the window's rows: over all their ticks, the
    p99's upper bound (`pooled_percentile`; None past the largest of `OVER_MS`) and the share of the ticks over
    each of `OVER_MS`; the worst row's p99 (of that row's ticks alone) and the most, the rows' median p50 and
    each row's p99, over `router_lag_rows` rows; the same of the part of the lag that was the router's own
    work; NaN with no row in the window."""
    lagged = [r for r in rows if "router/loop_lag_p99_ms" in r]
    ticks = sum(r[MetricKeys.LOOP_LAG_TICKS] for r in lagged)
    return {
        "router_lag_rows": len(lagged),
        "router_lag_ticks": ticks,
        "router_lag_p99_bound_ms": pooled_percentile(lagged, 99),
        "router_work_lag_p99_bound_ms": pooled_percentile(lagged, 99, work=True),
        **{
            f"router_{kind}_share_over_ms": {
                f"{ms:g}": sum(r[MetricKeys.loop_lag_over(ms, kind == "work_lag")] for r in lagged) / ticks
                if ticks
                else None
                for ms in OVER_MS
            }
            for kind in ("lag", "work_lag")
        },
        "router_lag_p50_ms": float(np.median([r["router/loop_lag_p50_ms"] for r in lagged]))
        if lagged
        else float("nan"),
        "router_lag_p99s_ms": [r["router/loop_lag_p99_ms"] for r in lagged],
        "router_lag_p99_ms": max((r["router/loop_lag_p99_ms"] for r in lagged), default=float("nan")),
        "router_lag_max_ms": max((r["router/loop_lag_max_ms"] for r in lagged), default=float("nan")),
        "router_work_lag_p99_ms": max((r["router/loop_work_lag_p99_ms"] for r in lagged), default=float("nan")),
        "router_work_lag_max_ms": max((r["router/loop_work_lag_max_ms"] for r in lagged), default=float("nan")),
    }


def _wait_bound(endpoint: str, router: subprocess.Popen, run_dir: Path, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Wait until the router listens at `endpoint`, within `timeout_s`. Its sockets are looked at, not
    connected to: a probe's connection would be a ZeroMQ handshake the router refuses and logs."""
    import psutil

    port = int(endpoint.rsplit(":", 1)[1])
    deadline = time.monotonic() + timeout_s
    while True:
        if router.poll() is not None:
            raise RuntimeError(f"the router exited ({router.returncode}):\n{_log_tail(run_dir)}")
        with contextlib.suppress(psutil.NoSuchProcess):
            sockets = psutil.Process(router.pid).net_connections("tcp")
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in sockets):
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router did not listen at {endpoint} within {timeout_s:g}s")
        time.sleep(0.05)


def _log_warnings(run_dir: Path) -> list[str]:
    """The router log's WARNING and ERROR lines so far, the time stamps left out (it logs at WARNING here)."""
    log = run_dir / "logs" / "router.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [line.split(" ", 2)[-1] for line in lines if " WARNING [" in line or " ERROR [" in line]


def _log_tail(run_dir: Path) -> str:
    log = run_dir / "logs" / "router.log"
    return log.read_text(errors="replace")[-3000:] if log.exists() else ""


def _figures(
    args: argparse.Namespace,
    plan: dict[str, Any],
    reports: dict[int, dict[str, Any]],
    t0: float,
    t1: float,
    router_cpus: tuple[float, float],
    sim_cpu: float,
    rss: int,
) -> dict[str, Any]:
    """The point's figures from the simulators' records over the window [t0, t1]; `router_cpus`: the router
    process's CPU seconds in the window, and its main thread's."""
    window = t1 - t0
    router_cpu, main_cpu = router_cpus
    served = {(origin, rid): s for r in reports.values() for origin, rid, s, _ in r["served"]}
    straight = [direct for r in reports.values() for *_, direct in r["served"]]
    requests = [q for r in reports.values() for q in r["requests"]]
    answered = sum(1 for _, _, _, done in requests if t0 <= done < t1)
    added, e2e, service = [], [], []
    for origin, rid, sent, done in requests:
        if t0 <= sent < t1 and (origin, rid) in served:
            s = served[(origin, rid)]
            e2e.append(done - sent)
            service.append(s)
            added.append(done - sent - s)
    samples = sum(n for r in reports.values() for at, n in r["samples"] if t0 <= at < t1)
    episodes = sum(1 for r in reports.values() for at in r["episodes"] if t0 <= at < t1)
    lag = [v for r in reports.values() for at, v in r["lag"] if t0 <= at < t1]
    queued = [v for r in reports.values() for at, v in r["queued"] if t0 <= at < t1]
    rps = answered / window
    added_ms = np.array(added) * 1000
    return {
        **{k: v for k, v in plan.items() if k != "capacities"},
        "window_s": window,
        "requests": answered,
        "rps": rps,
        "direct_fraction": sum(straight) / len(straight) if straight else float("nan"),
        "router_cpu_s": router_cpu,
        "router_cores": router_cpu / window,
        "router_cpu_us_per_request": router_cpu / answered * 1e6 if answered else float("nan"),
        "router_main_us_per_request": main_cpu / answered * 1e6 if answered else float("nan"),
        "sim_cores": sim_cpu / window,
        "added_p50_ms": _percentile(added_ms, 50),
        "added_p99_ms": _percentile(added_ms, 99),
        "added_mean_ms": float(added_ms.mean()) if len(added_ms) else float("nan"),
        "e2e_p50_ms": _percentile(np.array(e2e) * 1000, 50),
        "service_p50_ms": _percentile(np.array(service) * 1000, 50),
        "in_transit": rps * float(added_ms.mean()) / 1000 if len(added_ms) else float("nan"),
        "replica_queue_max": max(queued, default=0),
        "router_rss_mb": rss / 2**20,
        "samples_per_s": samples / window,
        "episodes_per_s": episodes / window,
        "router_cpu_us_per_episode": router_cpu / episodes * 1e6 if episodes else float("nan"),
        "sim_lag_p99_ms": _percentile(np.array(lag) * 1000, 99),
        "errors": sum(r["errors"] for r in reports.values()),
        "sample_mismatches": sum(r["mismatches"] for r in reports.values()),
        **{f"groups_{key}": sum(r["groups"].get(key, 0) for r in reports.values()) for key in GROUP_COUNTS},
        "steps": sum(r["steps"] for r in reports.values()),
        "shutdown": [r["shutdown"] for r in reports.values() if r["shutdown"]],
    }
