"""Recovery from lost processes, and what one kill a minute costs, on real training runs with real SIGKILLs.

1. Recovery per kind of fault: for each kind (env_worker, inference, trainer, router) a training run of
   `configs/plan_path_tiny.yaml` (the tiny model, 2 env workers, 2 replicas per policy) in which the bench
   SIGKILLs one process of that kind `--kills` times, each once the run has recovered from the previous one
   and made `--spacing` iterations of progress. Each recovery is the run's own `faults/recovery_s`: from
   the launcher finding the process dead to the first result of its replacement (an env worker and an
   inference replica are replaced alone: the replica's first generate result, in its re-formed weight
   group; a trainer or the router restarts the whole run from its last checkpoint, whose first finished
   episode ends the recovery, and the iterations since that checkpoint are run again: printed as
   "redone"). Median and max per kind. One more kind, `inference_loading`: a replica lost while its model
   loads, before its Hello (the commonest real failure: out of memory or a CUDA error during the load).
   The replicas load slowly (`bench/slow_backend.py`, `--load-s` before each replacement loads); the bench
   kills a replica that has joined, then its replacement while it loads; the recovery is the second
   replacement's (from the loading one found dead to its first generate result, `--load-s` of it the
   simulated load). It is replaced alone: nothing redone.
2. A slow replacement: a replica lost while the run steps, its replacement taking `--slow-load-s` to load,
   longer than `trainer.weight_sync_timeout_s` (`--slow-sync-timeout-s`): training episodes per second from
   the kill until the replacement joins, against the same run's rate over as long a window just before
   the kill (`--slow-repeats` kills, one replica of each policy in turn). Before replicas were replaced
   alone this cost a whole-run restart.
3. The throughput cost: the same run for `--duration-s` seconds without kills and with one kill every
   `--period-s` seconds (60: one a minute), of an env worker and an inference replica in turn
   (`--throughput-kinds`), `--repeats` times each, interleaved: training episodes per second of wall time
   (from the rows' `time/elapsed_s`), and their ratio (target >= 0.9).

    python bench/faults.py               # ~15 minutes on 2 cores
    python bench/faults.py --smoke       # ~1 minute: an env worker, a loading replica, a slow replacement; run by the tests
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.slow_backend import REPLACEMENT_ENV

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "plan_path_tiny.yaml"
KINDS = ("env_worker", "inference", "inference_loading", "trainer", "router")
SLOW_HF = "bench.slow_backend:SlowHF"
SETTLE_ITERATIONS = 5
"""Iterations run before each calm window of the slow-replacement runs."""
BATCH = 4
SETTINGS = [
    f"rollout.batch_size={BATCH}", "algorithm.k=4", "eval.every=0", "cluster.env_workers=2",
    "policies.vertical.replicas=2", "policies.horizontal.replicas=2", "trainer.checkpoint_every=2",
    "trainer.keep_checkpoints=1", "trainer.keep_best=false", "cluster.max_restarts=100",
]  # fmt: skip


class Run:
    """A `mas-async train` run in the background, stopped (and every process it started killed) by pid."""

    def __init__(
        self, run_dir: Path, load_s: float | None = None, *settings: str, config: Path | str | None = None
    ) -> None:
        """`load_s`: every replica's replacement loads that long first (`bench/slow_backend.py`); `config`: the
        run's config (default `CONFIG`, with this bench's `SETTINGS`; another one as it is, with `settings`)."""
        self.dir = run_dir
        env = os.environ.copy()
        if load_s is not None:
            settings = (*settings, *(f"policies.{p}.backend={SLOW_HF}" for p in ("vertical", "horizontal")))
            env[REPLACEMENT_ENV] = str(load_s)
        base = SETTINGS if config is None else []
        command = [sys.executable, "-m", "mas_async", "train", str(config or CONFIG), f"run.output_dir={run_dir}",
                   "run.iterations=100000", *base, *settings]  # fmt: skip
        self.log = (run_dir.parent / f"{run_dir.name}.out").open("w")
        self.proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def rows(self) -> list[dict]:
        path = self.dir / "metrics.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().split("\n")[:-1]  # a last line without its newline is still being written
        return [json.loads(line) for line in lines if line.strip()]

    def pids(self) -> dict[str, int]:
        path = self.dir / "pids.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):  # not written yet
            return {}

    def joined(self, name: str, pid: int) -> bool:
        """The router saw process `name` with `pid` join (the router itself: it has written a row)."""
        if name == "router":
            return True
        log = self.dir / "logs" / "router.log"
        return log.exists() and f"{name} joined (pid {pid})" in log.read_text(errors="replace")

    def replaced(self, name: str, pid: int) -> int:
        """The pid of the process the launcher started in place of `name`'s `pid`."""
        self.wait(f"{name} (pid {pid}) to be replaced", lambda: self.pids()[name] != pid, timeout_s=60)
        return self.pids()[name]

    def wait(self, what: str, condition, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the run stopped (status {self.proc.returncode}) while waiting for {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not happen within {timeout_s:g}s ({self.dir})")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        for pid in [self.proc.pid, *self.pids().values()]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait(10)
        self.log.close()


def _iterations_seen(rows: list[dict]) -> int:
    return len({row["iteration"] for row in rows})


def _restarts(rows: list[dict], kind: str) -> int:
    return sum(row[f"faults/restarts/{kind}"] for row in rows)


def _recoveries(rows: list[dict]) -> int:
    return sum(1 for row in rows if row["faults/recovery_s"] > 0)


def recoveries(kind: str, kills: int, spacing: int, work: Path, load_s: float) -> tuple[list[float], int]:
    """SIGKILL a process of `kind` `kills` times (`inference_loading`: a replica, then its replacement while
    it loads for `load_s`); the recovery times the run reported and the iterations it ran again (a whole-run
    restart goes back to the last checkpoint)."""
    loading = kind == "inference_loading"
    role = "inference" if loading else kind
    run = Run(work / f"recovery-{kind}", load_s if loading else None)
    redone = 0
    try:
        run.wait("the first rows", lambda: len(run.rows()) >= 2)
        for kill in range(kills):
            names = sorted(name for name in run.pids() if name.split("/")[0] == role)
            name = names[kill % len(names)]
            pid = run.pids()[name]
            run.wait(f"{name} (pid {pid}) to join", lambda n=name, p=pid: run.joined(n, p))
            os.kill(pid, signal.SIGKILL)
            seen = _iterations_seen(run.rows())
            if loading:  # its replacement sleeps `load_s` before it loads the model: killed before its Hello
                replacement = run.replaced(name, pid)
                if run.joined(name, replacement):
                    raise RuntimeError(f"{name}'s replacement joined before the bench could kill it: raise --load-s")
                os.kill(replacement, signal.SIGKILL)
            deaths = (kill + 1) * (2 if loading else 1)
            # Restarted and recovered (both in the rows), and `spacing` iterations of progress beyond where it was.
            run.wait(
                f"recovery {kill + 1} of {kind}",
                lambda s=seen, k=kill, d=deaths: _restarts(run.rows(), role) >= d and _recoveries(run.rows()) >= k + 1
                and _iterations_seen(run.rows()) >= s + spacing,
            )  # fmt: skip
            back_to = _restarted_from(run)
            redone += seen - back_to if back_to is not None else 0
        rows = run.rows()
    finally:
        run.stop()
    found = [r["faults/recovery_s"] for r in rows if r["faults/recovery_s"] > 0]  # one per kill: kills are spaced
    if len(found) != kills:
        raise RuntimeError(f"{kind}: {kills} kills but {len(found)} recoveries in the metrics ({run.dir})")
    if loading and (whole := sum(_restarts(rows, r) for r in ("trainer", "router"))):
        raise RuntimeError(f"{kind}: the run restarted whole {whole} times; a replica must be replaced alone")
    return found, redone


def _restarted_from(run: Run) -> int | None:
    """The version the last whole-run restart went back to (None: the run was never restarted)."""
    versions = [
        int(line.split("checkpoint of version ")[1].split()[0])
        for line in Path(run.log.name).read_text(errors="replace").splitlines()
        if "restarting the run from its checkpoint of version" in line
    ]
    return versions[-1] if versions else None


class EpisodeClock:
    """Training episodes finished by wall time: the rows' episode counts as the bench sees them appear."""

    def __init__(self, run: Run) -> None:
        self.run, self.seen, self.marks = run, 0, [(time.monotonic(), 0)]

    def poll(self) -> None:
        rows = self.run.rows()
        if len(rows) > self.seen:
            total = sum(r["rollout/episodes"] for r in rows)
            self.seen = len(rows)
            self.marks.append((time.monotonic(), total))

    def at(self, t: float) -> int:
        return max(n for when, n in self.marks if when <= t)

    def rate(self, start: float, end: float) -> float:
        return (self.at(end) - self.at(start)) / (end - start)

    def wait(self, seconds: float, condition=lambda: False) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not condition():
            if self.run.proc.poll() is not None:
                raise RuntimeError(f"the run stopped (status {self.run.proc.returncode}): {self.run.dir}")
            self.poll()
            time.sleep(0.05)


def slow_replacements(repeats: int, load_s: float, sync_timeout_s: float, work: Path) -> list[tuple[float, float]]:
    """Kill a replica `repeats` times (one of each policy in turn), each replacement loading for `load_s`,
    longer than the weight-sync bound: (episodes/s while it loads, episodes/s over as long just before)."""
    run = Run(work / "slow-replacement", load_s, f"trainer.weight_sync_timeout_s={sync_timeout_s:g}")
    clock, pairs = EpisodeClock(run), []
    try:
        run.wait("the first rows", lambda: len(run.rows()) >= 2)
        order = ["inference/vertical/0", "inference/horizontal/1", "inference/vertical/1", "inference/horizontal/0"]
        for repeat in range(repeats):
            name = order[repeat % len(order)]
            pid = run.pids()[name]
            run.wait(f"{name} (pid {pid}) to join", lambda n=name, p=pid: run.joined(n, p))
            settled = len(run.rows()) + SETTLE_ITERATIONS  # past the start, or the last replacement's catch-up
            run.wait(f"{SETTLE_ITERATIONS} iterations before the calm window", lambda s=settled: len(run.rows()) >= s)
            calm_start = time.monotonic()
            clock.wait(load_s)  # the calm window, as long as the load
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            new = run.replaced(name, pid)
            clock.wait(load_s + 120, lambda n=name, p=new: run.joined(n, p))
            if not run.joined(name, new):
                raise TimeoutError(f"{name}'s replacement (pid {new}) never joined ({run.dir})")
            joined = time.monotonic()
            clock.wait(0.5)  # the rows of the window's last iterations
            pairs.append((clock.rate(killed, joined), clock.rate(calm_start, killed)))
        rows = run.rows()
    finally:
        run.stop()
    if whole := sum(_restarts(rows, r) for r in ("trainer", "router")):
        raise RuntimeError(f"slow replacements: the run restarted whole {whole} times ({run.dir})")
    return pairs


def throughput(period_s: float | None, duration_s: float, work: Path, label: str, kinds: list[str]) -> float:
    """Training episodes per second of wall time over `duration_s` (after the first row), killing a process
    of `kinds` in turn every `period_s` seconds (None: never)."""
    run = Run(work / f"throughput-{label}")
    kills = 0
    try:
        run.wait("the first row", lambda: len(run.rows()) >= 1)
        by_kind = [[n for n in sorted(run.pids()) if n.split("/")[0] == kind] for kind in kinds]
        order = [name for turn in itertools.zip_longest(*by_kind) for name in turn if name]  # one of each in turn
        start = time.monotonic()
        next_kill = start + period_s if period_s else float("inf")
        while time.monotonic() - start < duration_s:
            if time.monotonic() >= next_kill:
                name = order[kills % len(order)]
                pid = run.pids()[name]
                if run.joined(name, pid):
                    os.kill(pid, signal.SIGKILL)
                    kills += 1
                    next_kill += period_s
            if run.proc.poll() is not None:
                raise RuntimeError(f"the run stopped (status {run.proc.returncode}): {run.dir}")
            time.sleep(0.1)
        counted = lambda: sum(_restarts(run.rows(), kind) for kind in kinds)  # noqa: E731
        run.wait("every kill counted", lambda: counted() >= kills, timeout_s=60)
        rows = run.rows()
    finally:
        run.stop()
    if sum(_restarts(rows, kind) for kind in kinds) != kills:
        raise RuntimeError(f"{kills} kills, {sum(_restarts(rows, kind) for kind in kinds)} restarts counted")
    first, last = rows[0], rows[-1]
    episodes = sum(r["rollout/episodes"] for r in rows[1:])
    return episodes / (last["time/elapsed_s"] - first["time/elapsed_s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default=",".join(KINDS), help="kinds of process to kill, comma-separated")
    parser.add_argument("--kills", type=int, default=5, help="kills per kind")
    parser.add_argument("--spacing", type=int, default=3, help="iterations of progress between kills")
    parser.add_argument("--duration-s", type=float, default=180.0, help="length of each throughput run")
    parser.add_argument("--period-s", type=float, default=60.0, help="one kill per this many seconds")
    parser.add_argument(
        "--throughput-kinds", default="env_worker,inference", help="kinds killed in turn in the throughput runs"
    )
    parser.add_argument("--repeats", type=int, default=1, help="throughput runs per arm (interleaved)")
    parser.add_argument("--load-s", type=float, default=1.0, help="inference_loading: a replacement's load time")
    parser.add_argument("--slow-load-s", type=float, default=20.0, help="a slow replacement's load time (0: none)")
    parser.add_argument("--slow-sync-timeout-s", type=float, default=10.0, help="weight-sync bound, slow runs")
    parser.add_argument("--slow-repeats", type=int, default=3, help="slow replacements, one run")
    parser.add_argument(
        "--smoke", action="store_true", help="one kill of two kinds, one slow replacement, no throughput"
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.smoke:
        args.kinds, args.kills, args.spacing, args.duration_s = "env_worker,inference_loading", 1, 1, 0.0
        args.slow_load_s, args.slow_sync_timeout_s, args.slow_repeats = 6.0, 3.0, 1
    kinds = [k for k in args.kinds.split(",") if k]
    turn = [k for k in args.throughput_kinds.split(",") if k]
    for kind in kinds:
        if kind not in KINDS:
            parser.error(f"--kinds: unknown kind {kind!r} (known: {', '.join(KINDS)})")
    for kind in turn:
        if kind not in ("env_worker", "inference"):
            parser.error(f"--throughput-kinds: {kind!r} is not replaced alone (env_worker, inference)")
    with tempfile.TemporaryDirectory(prefix="mas-async-faults-") as tmp:
        work = Path(tmp)
        print(f"recovery per kind of fault: {args.kills} SIGKILLs each, {args.spacing} iterations apart")
        print(f"  {'kind':<18} {'median s':>9} {'max s':>7} {'redone':>7}   every recovery (s)")
        figures: dict = {"recovery_s": {}, "redone": {}}
        for kind in kinds:
            found, redone = recoveries(kind, args.kills, args.spacing, work, args.load_s)
            figures["recovery_s"][kind], figures["redone"][kind] = found, redone
            listed = ", ".join(f"{s:.2f}" for s in found)
            print(
                f"  {kind:<18} {statistics.median(found):>9.2f} {max(found):>7.2f} {redone:>7}   {listed}", flush=True
            )
        if "inference_loading" in kinds:
            print(f"  (inference_loading: a replica killed, then its replacement while it loads; {args.load_s:g} s of "
                  "each recovery is the next replacement's simulated load)")  # fmt: skip
        if args.slow_load_s > 0:
            pairs = slow_replacements(args.slow_repeats, args.slow_load_s, args.slow_sync_timeout_s, work)
            ratios = [loading / calm for loading, calm in pairs]
            print(f"\nslow replacement: a replica lost, its replacement loading {args.slow_load_s:g} s (weight-sync bound "
                  f"{args.slow_sync_timeout_s:g} s), {len(pairs)} times:")  # fmt: skip
            print(f"  while it loads   {', '.join(f'{a:.2f}' for a, _ in pairs)} training episodes/s")
            print(f"  just before      {', '.join(f'{c:.2f}' for _, c in pairs)} training episodes/s")
            print(f"  kept             {statistics.median(ratios):.3f} (median of {len(ratios)}; "
                  f"{', '.join(f'{r:.3f}' for r in ratios)})")  # fmt: skip
            figures["slow_replacement"] = {"while_loading": [a for a, _ in pairs], "before": [c for _, c in pairs],
                                           "ratios": ratios}  # fmt: skip
        if args.duration_s > 0:
            calm, killed = [], []
            for repeat in range(args.repeats):
                calm.append(throughput(None, args.duration_s, work, f"calm-{repeat}", turn))
                killed.append(throughput(args.period_s, args.duration_s, work, f"killed-{repeat}", turn))
            ratios = [k / c for k, c in zip(killed, calm, strict=True)]
            print(
                f"\nthroughput, {args.duration_s:g} s runs, one kill per {args.period_s:g} s ({', '.join(turn)} in turn):"
            )
            print(f"  no kills     {', '.join(f'{x:.2f}' for x in calm)} training episodes/s")
            print(f"  with kills   {', '.join(f'{x:.2f}' for x in killed)} training episodes/s")
            print(f"  ratio        {statistics.median(ratios):.3f} (median of {len(ratios)}; "
                  f"{', '.join(f'{r:.3f}' for r in ratios)})   (target >= 0.9)")  # fmt: skip
            figures["throughput"] = {"no_kills": calm, "with_kills": killed, "ratios": ratios}
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
