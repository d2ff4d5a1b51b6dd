"""The router's work per finished episode against the number of env workers: the EpisodeDone, and the RunEpisode
that refills the freed slot on the least-loaded worker with room.

One process, no sockets: the real `Router` with its socket replaced by a recorder, `--workers` env workers of
`--capacity` episodes each (every count of the list the same total of concurrent episodes), a strict iteration far
larger than what runs at once, all of it dispatched; then episodes end one at a time, each worker's oldest first,
and each ending refills its slot. Printed per worker count: the microseconds of the router's handling per episode
(the median of `--repeat` runs of `--episodes` episodes), and its ratio to the fewest workers' (1.0: the cost does not
grow with the workers).

    python bench/router_refill.py              # 64, 512 and 1,024 workers
    python bench/router_refill.py --smoke      # seconds; run by the tests
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import deque
from datetime import datetime
from pathlib import Path
from typing import Any

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.machine_paths import without_machine_paths
from mas_async.router.hub import Router
from mas_async.wire.messages import PROTOCOL_VERSION, EpisodeDone, Hello, RunEpisode, decode

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/plan_path_tiny.yaml"


class _Recorder:
    """Stands in for the router's socket: keeps what it would send."""

    def __init__(self) -> None:
        self.frames: list[list] = []

    def send(self, frames: list) -> None:
        self.frames.append(frames)


def per_episode_us(workers: int, capacity: int, episodes: int) -> float:
    """Microseconds of the router's handling per EpisodeDone (the refill included) over `episodes` endings."""
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(CONFIG, [
            "env.train_size=64", "env.test_size=8", "rollout.max_staleness=0", "eval.every=0",
            f"rollout.batch_size={workers * capacity + episodes}", f"cluster.env_workers={workers}",
        ])  # fmt: skip
        deployment = Deployment(
            "tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 1}, {"vertical": "", "horizontal": ""}
        )
        router = Router(config, deployment, Path(run_dir))
        io = router.io = _Recorder()
        for i in range(workers):
            name = f"env_worker/{i}"
            router._on_hello(name.encode(), Hello("env_worker", name, "", capacity, PROTOCOL_VERSION, i))
        io.frames.clear()
        router._open_book(0, train=True, evaluate=False)  # (no loop running: it dispatches all it may at once)
        running: deque[tuple[bytes, RunEpisode]] = deque((f[0], decode(f[1:])) for f in io.frames)
        if len(running) != workers * capacity:
            raise RuntimeError(f"{len(running)} episodes dispatched, expected {workers * capacity}")
        io.frames.clear()
        summary = {"success": True, "tokens": 3, "turns": 1}
        spent = 0.0
        for _ in range(episodes):
            worker, run = running.popleft()
            done = EpisodeDone(run.episode_id, run.iteration, run.mode, run.attempt, "", summary, {})
            start = time.perf_counter()
            router._handle(worker, done)
            spent += time.perf_counter() - start
            (refill,) = io.frames  # one RunEpisode per ending: the freed slot refilled
            running.append((refill[0], decode(refill[1:])))
            io.frames.clear()
        return spent / episodes * 1e6


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[64, 512, 1024], help="env worker counts")
    p.add_argument("--concurrent", type=int, default=4096, help="concurrent episodes at every worker count")
    p.add_argument("--episodes", type=int, default=20_000, help="episodes that end per run")
    p.add_argument("--repeat", type=int, default=3, help="runs per worker count, in turn")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    p.add_argument("--smoke", action="store_true", help="a tiny run (seconds), for the tests")
    args = p.parse_args(argv)
    if args.smoke:
        args.workers, args.concurrent, args.episodes, args.repeat = [4, 64], 256, 500, 1
    for name in ("concurrent", "episodes", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    for workers in args.workers:
        if workers < 1 or args.concurrent % workers:
            p.error(f"--workers {workers}: every count must be at least 1 and divide --concurrent {args.concurrent}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    runs: dict[int, list[float]] = {w: [] for w in args.workers}
    for _ in range(args.repeat):
        for workers in args.workers:
            runs[workers].append(per_episode_us(workers, args.concurrent // workers, args.episodes))
    fewest = min(args.workers)
    base = statistics.median(runs[fewest])
    print(f"the router per finished episode (its refill included), {args.concurrent} concurrent episodes, "
          f"{args.episodes} endings a run, median of {args.repeat}:")  # fmt: skip
    rows = {}
    for workers in args.workers:
        us = statistics.median(runs[workers])
        rows[workers] = {"us_per_episode": us, "runs": runs[workers], "ratio_to_fewest": us / base}
        print(f"  {workers:>5} env workers x {args.concurrent // workers:>4}: {us:6.1f} us "
              f"({min(runs[workers]):.1f}-{max(runs[workers]):.1f}), {us / base:.2f}x of {fewest} workers'")  # fmt: skip
    figures = {"bench": "router_refill", "date": datetime.now().isoformat(timespec="seconds"), "args": vars(args),
               "workers": rows}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(without_machine_paths(figures), indent=1, default=str))
    return figures


if __name__ == "__main__":
    main()
