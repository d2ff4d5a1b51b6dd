"""Requests per second through the router, against a raw pyzmq forwarder on the same machine.

Both runs use the same processes at the ends, which do as little as possible so that the middle is what
is measured:

- clients (as env workers): a DEALER each, keeping `--window` Generate requests in flight (a prompt of
  `--prompt-tokens` ids, n = `--n`); each reply frees a slot;
- echo servers (as mock inference servers): a DEALER each, answering every Generate at once with a
  GenerateResult of n completions of `--completion-tokens` tokens (pre-encoded payload).

The middle is the real router (`python -m mas_async.launch.process router`, which decodes the kind and header
of every message, balances by outstanding requests, keeps the pending map, and forwards the payload
undecoded), or one of two raw forwarders that route frames between fixed pairs (client i <-> server i)
with no decoding at all: a ROUTER socket on uvloop + zmq.asyncio awaiting each message ("raw"), and a
ROUTER socket in a blocking pyzmq loop ("raw-sync"). The ratio is taken against the faster of the two.
The real router runs twice: with plain sockets ("router", the ratio above) and with CURVE ("router-curve":
the run's keys, every client and server a CURVE client, the router's ZAP handler checking each key), which
gives the cost of CURVE: router-curve / router requests/s (target >= 0.90, i.e. CURVE costs at most 10%).
Each middle runs `--rounds` times, in turn; the best round of each counts (this machine is shared).
Beside the requests/s, each middle's CPU per request over the measured window: the middle process's, and every
process's of the run (clients, echo servers, middle: on a machine where they all compete for the cores, what
bounds the requests/s), with their ratios against the fastest raw forwarder's; the load of a shared machine moves
these less than the requests/s. And per role (middle, clients, echo servers): CPU per request and the voluntary
context switches of the main threads per request (how often each slept waiting for a message).

    python bench/router.py                # the requests/s of each, the ratio (target >= 1.0), CPU ratios, CURVE ratio
    python bench/router.py --smoke        # seconds; run by the tests
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from mas_async.machine_paths import without_machine_paths
from mas_async.runtime.curve import secure_client
from mas_async.wire.codec import pack, unpack
from mas_async.wire.messages import (
    PROTOCOL_VERSION,
    Generate,
    GenerateResult,
    Hello,
    Kind,
    Welcome,
    decode,
    encode,
)

ROOT = Path(__file__).resolve().parents[1]

POLICY = "shared"
GENERATE = bytes([Kind.GENERATE])
RESULT = bytes([Kind.GENERATE_RESULT])
PING = b"ping"


Keys = tuple[str, dict[str, str]] | None
"""The run's keys folder and every process's secret key (None: plain sockets)."""


def client_name(i: int) -> str:
    return f"env_worker/{i}"


def server_name(i: int) -> str:
    return f"inference/{POLICY}/{i}"


def _socket(ctx: zmq.Context, identity: str, endpoint: str, keys: Keys) -> zmq.Socket:
    """A DEALER connected to the middle; a CURVE client with `identity`'s own key when `keys` are given."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    if keys is not None:
        secure_client(sock, keys[0], keys[1][identity])
    sock.connect(endpoint)
    return sock


def _join(sock: zmq.Socket, role: str, identity: str, capacity: int) -> None:
    """Hello/Welcome with the router (the raw forwarder needs none)."""
    sock.send_multipart(
        encode(Hello(role, identity, POLICY if role != "env_worker" else "", capacity, PROTOCOL_VERSION, os.getpid()))
    )
    if not sock.poll(60_000):
        raise TimeoutError(f"{identity}: no Welcome from the router in 60s")
    reply = decode(sock.recv_multipart())
    if not isinstance(reply, Welcome):
        raise RuntimeError(f"{identity}: expected Welcome, got {type(reply).__name__}")


def echo_server(endpoint: str, keys: Keys, index: int, join: bool, n: int, completion_tokens: int, ready: Any) -> None:
    """Answer every Generate at once with n pre-encoded completions."""
    completion = [np.zeros(completion_tokens, np.int32), np.zeros(completion_tokens, np.float32), 0, "length"]
    payload = encode(GenerateResult(0, "", "", [completion] * n))[2]
    ctx = zmq.Context()
    sock = _socket(ctx, server_name(index), endpoint, keys)
    if join:
        _join(sock, "inference", server_name(index), 1 << 20)
        ready.put(index)
    else:
        sock.send(PING)  # the raw forwarder reports this server ready once it has seen it
    while True:
        frames = sock.recv_multipart(copy=False)
        if frames[0].bytes != GENERATE:
            continue  # heartbeats
        request_id, _policy, origin, _deadline = unpack(frames[1].buffer)
        sock.send_multipart([RESULT, pack([request_id, origin, ""]), payload], copy=False)


def client(
    endpoint: str,
    keys: Keys,
    index: int,
    join: bool,
    window: int,
    n: int,
    prompt_tokens: int,
    warmup_s: float,
    seconds: float,
    go: Any,
    out: Any,
) -> None:
    """Keep `window` requests in flight; report the replies counted during the measured window."""
    name = client_name(index)
    request = Generate(0, POLICY, name, 0.0, np.arange(prompt_tokens, dtype=np.int32) % 50, n, 32, 1.0, 1.0, False, [0])
    payload = encode(request)[2]
    ctx = zmq.Context()
    sock = _socket(ctx, name, endpoint, keys)
    if join:
        _join(sock, "env_worker", name, 1)
    if not go.wait(120):
        raise TimeoutError(f"{name}: the servers never became ready")
    next_id, in_flight, counted = 0, 0, 0
    start = time.perf_counter()
    measure_from, stop_at = start + warmup_s, start + warmup_s + seconds
    while True:
        now = time.perf_counter()
        if now >= stop_at:
            break
        while in_flight < window:
            header = pack([next_id, POLICY, name, time.time() + 60])
            sock.send_multipart([GENERATE, header, payload], copy=False)
            next_id += 1
            in_flight += 1
        if not sock.poll(30_000):
            raise TimeoutError(f"{name}: no reply in 30s with {in_flight} requests in flight")
        frames = sock.recv_multipart(copy=False)
        if frames[0].bytes == RESULT:
            in_flight -= 1
            if now >= measure_from:
                counted += 1
    out.put(counted / seconds)


def raw_forwarder(endpoint: str, pairs: int, ready: Any) -> None:
    """The baseline middle: a ROUTER socket on uvloop forwarding between fixed pairs, no decoding.
    (A server's first message, a ping, tells it that the server is connected: until then a ROUTER
    socket drops frames for that identity.)"""
    import uvloop
    import zmq.asyncio

    route = {}
    for i in range(pairs):
        route[client_name(i).encode()] = server_name(i).encode()
        route[server_name(i).encode()] = client_name(i).encode()

    async def forward() -> None:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.bind(endpoint)
        for _ in range(pairs):
            identity, _ping = await sock.recv_multipart()
            ready.put(identity)
        while True:
            frames = await sock.recv_multipart(copy=False)
            await sock.send_multipart([route[frames[0].bytes], *frames[1:]], copy=False)

    uvloop.run(forward())


def raw_sync_forwarder(endpoint: str, pairs: int, ready: Any) -> None:
    """The leanest middle: the same forwarding as `raw_forwarder` in a blocking pyzmq loop, no event loop."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.bind(endpoint)
    route = {}
    for i in range(pairs):
        route[client_name(i).encode()] = server_name(i).encode()
        route[server_name(i).encode()] = client_name(i).encode()
    for _ in range(pairs):
        identity, _ping = sock.recv_multipart()
        ready.put(identity)
    while True:
        frames = sock.recv_multipart(copy=False)
        sock.send_multipart([route[frames[0].bytes], *frames[1:]], copy=False)


def start_router(run_dir: Path, pairs: int, curve: bool) -> tuple[str, Keys, subprocess.Popen]:
    """The real router as its own process, configured for `pairs` env workers and inference replicas;
    returns its endpoint, the run's keys (`curve`, else None: the folder and every process's secret key)
    and the process."""
    from mas_async.config import dump_config, load_config
    from mas_async.deployment import Deployment, free_ports
    from mas_async.runtime.curve import SECRET_ENV, issued_secret, prepare_keys

    overrides = [
        f"run.output_dir={run_dir}",
        "eval.every=0",
        "rollout.batch_size=1",
        "env.train_size=8",
        "env.test_size=1",
        f"cluster.env_workers={pairs}",
        f"policies.{POLICY}.replicas={pairs}",
        "cluster.peer_timeout_s=3600",
        "rollout.episode_timeout_s=3600",
        f"cluster.curve={str(curve).lower()}",
    ]
    config = load_config(ROOT / "configs" / "plan_path_tiny_shared.yaml", overrides)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    dump_config(config, run_dir / "config.yaml")
    endpoint = f"tcp://127.0.0.1:{free_ports('127.0.0.1', 1)[0]}"
    names = ["router", f"trainer/{POLICY}", *(server_name(i) for i in range(pairs)), *map(client_name, range(pairs))]
    keys_dir = prepare_keys(config, run_dir, names)
    keys = None if keys_dir is None else (keys_dir, {name: issued_secret(keys_dir, name) for name in names})
    Deployment(endpoint, {POLICY: 0}, {POLICY: ""}, keys_dir=keys_dir).save(run_dir / "deployment.json")
    with (run_dir / "logs" / "router.log").open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mas_async.launch.process", "router", str(run_dir)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **({SECRET_ENV: keys[1]["router"]} if keys else {})},
        )
    return endpoint, keys, proc


def measure(args: argparse.Namespace, middle: str, run_dir: Path) -> tuple[float, float, float, dict[str, list[float]]]:
    """(requests per second of all clients together, CPU microseconds per request of the middle, and of every
    process of the run: the middle, the clients and the echo servers; and per role, middle, clients and servers,
    [CPU microseconds, voluntary context switches of the main threads] per request: how often they slept)."""
    import psutil

    from mas_async.deployment import free_ports

    spawn = mp.get_context("spawn")
    out, ready, go = spawn.Queue(), spawn.Queue(), spawn.Event()
    procs: list[Any] = []
    router = None
    join = middle in ("router", "router-curve")
    keys: Keys = None
    try:
        if join:
            endpoint, keys, router = start_router(run_dir, args.pairs, curve=middle == "router-curve")
            # The router waits for every peer of its deployment, its trainer included.
            trainer = _socket(zmq.Context.instance(), f"trainer/{POLICY}", endpoint, keys)
        else:
            endpoint = f"tcp://127.0.0.1:{free_ports('127.0.0.1', 1)[0]}"
            target = raw_forwarder if middle == "raw" else raw_sync_forwarder
            procs.append(spawn.Process(target=target, args=(endpoint, args.pairs, ready), daemon=True))
        for i in range(args.pairs):
            procs.append(
                spawn.Process(
                    target=echo_server,
                    args=(endpoint, keys, i, join, args.n, args.completion_tokens, ready),
                    daemon=True,
                )
            )
        load = (args.window, args.n, args.prompt_tokens, args.warmup, args.seconds, go, out)
        clients = [
            spawn.Process(
                target=client,
                args=(endpoint, keys, i, join, *load),
                daemon=True,
            )
            for i in range(args.pairs)
        ]
        procs += clients
        for p in procs:
            p.start()
        if join:
            _join(trainer, "trainer", f"trainer/{POLICY}", 0)
        for _ in range(args.pairs):
            ready.get(timeout=120)
        middle_proc = psutil.Process(router.pid if router is not None else procs[0].pid)
        every = [middle_proc] + [psutil.Process(p.pid) for p in procs if p.pid != middle_proc.pid]
        roles = {
            "middle": [middle_proc],
            "clients": [psutil.Process(p.pid) for p in clients],
            "servers": [psutil.Process(p.pid) for p in procs if p not in clients and p.pid != middle_proc.pid],
        }
        go.set()
        time.sleep(args.warmup)
        cpu0 = sum(middle_proc.cpu_times()[:2])
        all0 = sum(sum(proc.cpu_times()[:2]) for proc in every)
        roles0 = _role_counts(roles)
        if args.profile and router is not None:
            subprocess.run(
                [
                    "py-spy",
                    "record",
                    "--nonblocking",
                    "-r",
                    "250",
                    "-d",
                    str(int(args.seconds)),
                    "-p",
                    str(router.pid),
                    "-f",
                    "raw",
                    "-o",
                    str(args.profile),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        else:
            time.sleep(args.seconds)
        cpu = sum(middle_proc.cpu_times()[:2]) - cpu0
        cpu_all = sum(sum(proc.cpu_times()[:2]) for proc in every) - all0
        roles1 = _role_counts(roles)
        rates: list[float] = []
        deadline = time.monotonic() + args.warmup + args.seconds + 120
        while len(rates) < len(clients):
            dead = [p for p in procs if not p.is_alive() and p.exitcode != 0]
            if dead or time.monotonic() > deadline or (router is not None and router.poll() is not None):
                raise RuntimeError(f"the {middle} run failed (a process died or it ran past its deadline)")
            try:
                rates.append(out.get(timeout=0.5))
            except queue.Empty:
                continue
        rate = float(sum(rates))
        if rate <= 0:
            logs = "".join(f.read_text()[-2000:] for f in run_dir.glob("logs/*.log"))
            raise RuntimeError(f"the {middle} run forwarded no request in the measured window\n{logs}")
        count = rate * args.seconds
        per_role = {
            role: [(roles1[role][0] - roles0[role][0]) / count * 1e6, (roles1[role][1] - roles0[role][1]) / count]
            for role in roles
        }
        return rate, cpu / count * 1e6, cpu_all / count * 1e6, per_role
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        if router is not None:
            router.kill()
            router.wait(timeout=10)
        if join:
            trainer.close(linger=0)


def _role_counts(roles: dict[str, list[Any]]) -> dict[str, tuple[float, int]]:
    """Per role: (CPU seconds, voluntary context switches of the main threads) of its processes so far."""
    return {
        role: (
            sum(sum(proc.cpu_times()[:2]) for proc in procs),
            sum(proc.num_ctx_switches().voluntary for proc in procs),
        )
        for role, procs in roles.items()
    }


MIDDLES = {
    "raw": "raw pyzmq forwarder (uvloop + zmq.asyncio)",
    "raw-sync": "raw pyzmq forwarder (blocking loop)",
    "router": "mas-async router",
    "router-curve": "mas-async router, CURVE on every socket",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=1, help="clients, and echo servers (one per client)")
    p.add_argument("--window", type=int, default=64, help="requests in flight per client")
    p.add_argument("--n", type=int, default=8, help="completions per request")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--completion-tokens", type=int, default=32)
    p.add_argument("--warmup", type=float, default=1.0, help="seconds before counting")
    p.add_argument("--seconds", type=float, default=5.0, help="seconds counted per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per middle, alternating")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    p.add_argument("--middles", nargs="+", choices=list(MIDDLES), default=list(MIDDLES), help="what to measure")
    p.add_argument("--profile", type=Path, help="record the router with py-spy (collapsed stacks) into this file")
    p.add_argument("--smoke", action="store_true", help="a tiny run (seconds), for the tests")
    args = p.parse_args(argv)
    if args.smoke:
        args.window, args.warmup, args.seconds, args.rounds = 8, 0.2, 0.5, 1
    if args.rounds < 1 or args.pairs < 1 or args.window < 1:
        p.error("--rounds, --pairs and --window must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    measured = [m for m in MIDDLES if m in args.middles]  # (in MIDDLES' order; one left out is absent below)
    rates: dict[str, list[float]] = {m: [] for m in measured}
    cpu: dict[str, list[float]] = {m: [] for m in measured}
    cpu_all: dict[str, list[float]] = {m: [] for m in measured}
    per_role: dict[str, list[dict[str, list[float]]]] = {m: [] for m in measured}
    with tempfile.TemporaryDirectory(prefix="mas-async-bench-router-") as tmp:
        for round_ in range(args.rounds):
            for middle in measured:
                rate, cpu_us, all_us, roles = measure(args, middle, Path(tmp) / f"{middle}{round_}")
                per_role[middle].append(roles)
                rates[middle].append(rate)
                cpu[middle].append(cpu_us)
                cpu_all[middle].append(all_us)
    best = {m: max(r) for m, r in rates.items()}
    best_cpu = {m: min(c) for m, c in cpu.items()}
    best_all = {m: min(c) for m, c in cpu_all.items()}
    raws = [m for m in ("raw", "raw-sync") if m in best]
    raw = max(raws, key=lambda m: best[m]) if raws else None  # the faster baseline is the one compared against
    print(
        f"router throughput: {args.pairs} client(s) x {args.window} in flight, n={args.n}, prompt "
        f"{args.prompt_tokens} tokens, {args.completion_tokens}-token completions; best of {args.rounds} rounds, "
        "CPU per request of the middle and of every process (clients, echo servers, middle)"
    )
    for middle in measured:
        rounds = ", ".join(f"{r:.0f}" for r in rates[middle])
        print(
            f"  {MIDDLES[middle]:<44} {best[middle]:>8.0f} requests/s  {best_cpu[middle]:>5.0f} us CPU/request  "
            f"{best_all[middle]:>5.0f} us all processes  ({rounds})"
        )
    print("  per request, by role (medians of the rounds): CPU us / voluntary context switches of the main threads")
    for middle in measured:
        cells = [
            f"{role} {statistics.median(r[role][0] for r in per_role[middle]):.0f} us / "
            f"{statistics.median(r[role][1] for r in per_role[middle]):.2f}"
            for role in ("middle", "clients", "servers")
        ]
        print(f"  {MIDDLES[middle]:<44} " + ", ".join(cells))
    ratio = cpu_ratio = all_ratio = None  # --middles may leave a side out
    if raw is not None and "router" in best:
        ratio, cpu_ratio = best["router"] / best[raw], best_cpu[raw] / best_cpu["router"]
        all_ratio = best_all[raw] / best_all["router"]
        print(f"router ratio (router / fastest raw forwarder, {raw}, requests/s): {ratio:.3f}   (target >= 1.0)")
        print(f"router CPU ratio ({raw} / router CPU per request, the middle's): {cpu_ratio:.3f}")
        print(f"router CPU ratio, every process ({raw} / router CPU per request of the whole run): {all_ratio:.3f}")
    curve_ratio = curve_cpu_ratio = None
    if "router-curve" in best and "router" in best:
        curve_ratio = best["router-curve"] / best["router"]
        curve_cpu_ratio = best_cpu["router"] / best_cpu["router-curve"]
        print(f"CURVE ratio (router with CURVE / router without, requests/s): {curve_ratio:.3f}   (target >= 0.90)")
        print(f"CURVE CPU ratio (router without / with CURVE, CPU per request): {curve_cpu_ratio:.3f}")
    if args.json:
        result = {
            "bench": "router",
            "date": datetime.now().isoformat(timespec="seconds"),
            "args": vars(args),
            "rates": rates,
            "cpu_us": cpu,
            "cpu_us_all_processes": cpu_all,
            "per_role": per_role,
            "baseline": raw,
            "ratio": ratio,
            "cpu_ratio": cpu_ratio,
            "all_processes_cpu_ratio": all_ratio,
            "curve_ratio": curve_ratio,
            "curve_cpu_ratio": curve_cpu_ratio,
        }
        args.json.write_text(json.dumps(without_machine_paths(result), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
