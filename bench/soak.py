"""A run that lasts, under faults: does any process's memory, open files or threads grow, and does the run
directory grow faster than its iterations?

    python bench/soak.py configs/plan_path_tiny.yaml --minutes 60 --kill-every 60
    python bench/soak.py configs/plan_path_tiny.yaml --minutes 60 --kill-every 60 cluster.leases=true
    python bench/soak.py configs/plan_path_tiny.yaml --smoke       # 1 minute, run by the tests

The config trains under the local engine for `--minutes` (its iterations made endless), while the bench
SIGKILLs a random env worker or inference replica every `--kill-every` seconds, and once each, at random times
in the middle of the run, a trainer rank and the router (the whole run then restarts from its last
checkpoint). Every `--sample-s` seconds it records each process's RSS, open file descriptors and threads
(psutil; by role: router, env_worker, inference, trainer, launcher) and the run directory's size by part
(checkpoints, logs, metrics.jsonl, tensorboard, the rest). For the roles of `--parts-roles` (the trainers, the
router and the launcher by default) it also splits RSS by where it lies (bench/memory_parts.py: glibc's main heap,
its per-thread arenas, other anonymous mappings, files), and prints each part's growth the same way.

It prints, after the warm-up (`--warmup-min`, the first 10 minutes by default):
- each role's growth per hour: RSS in MB/h and %/h, fds and threads per hour, the median and the worst over
  the role's processes, each fitted only on its samples past its own first `--own-warmup-min` minutes (10 by
  default): a process's first minutes are its warm-up, caches filling to their bound (as the env workers'
  tokenizer word caches did, ~15 MB a policy over ~10 minutes, before they were turned off: docs/faults.md),
  which a line through a replacement killed at minute 5 reads as growth for ever. Each figure says how many processes
  and process-minutes it rests on; a role with none (its processes all killed young) gets no figure, never 0.0;
- for every role, each process's RSS at the same own age (`--age-s`) against when it started: whether later
  replacements start bigger (a leak inherited from the fork server or kept by a peer), the one figure a role
  killed young still gets;
- the run directory's growth per iteration, by part (bytes a training iteration adds);
- the run's own checks: every iteration's row once, every `version_mismatch` 0, and no episode lost without
  being counted (each training row's episodes + dropped = `rollout.batch_size`); and its end: asked to stop
  at its next checkpoint (as a SLURM job's signal asks, stop_request.py), the run exits by itself, status 0.
`--json FILE` writes the samples, the figures and the checks. Growth is a least-squares slope over a process's
samples; a process sampled less than `--min-span-s` past both warm-ups gives none.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.faults import Run
from bench.memory_parts import PARTS as MEMORY_PARTS
from bench.memory_parts import memory_parts
from mas_async.machine_paths import shown_path

SETTINGS = ["eval.every=0", "cluster.max_restarts=1000", "trainer.keep_best=false"]
"""What every soak run sets: no evaluation (the rows are the training iterations'), restarts enough for an hour."""
KILLED = ("env_worker", "inference")
ONCE = ("trainer", "router")
PARTS = ("checkpoints", "logs", "metrics.jsonl", "tensorboard")
MB = 1e6
RATES = ("rss_mb_per_h", "rss_pct_per_h", "fds_per_h", "threads_per_h")
WHICH = ("median", "worst")
RANGES = ("fds_range", "threads_range")


@dataclass
class Series:
    """One process's samples: (seconds since the soak began, rss bytes, fds, threads)."""

    role: str
    name: str
    pid: int
    samples: list[tuple[float, int, int, int]] = field(default_factory=list)
    parts: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    """(seconds, resident bytes by memory part), for the roles whose RSS the soak splits."""


def role_of(name: str) -> str:
    return name.split("/")[0]


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per hour."""
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return 3600 * sum((t - mean_t) * (v - mean_v) for t, v in points) / var if var > 0 else 0.0


def dir_parts(run_dir: Path) -> dict[str, int]:
    """Bytes of the run directory by part."""
    sizes = dict.fromkeys((*PARTS, "other"), 0)
    for folder, _, files in os.walk(run_dir):  # (os.walk skips a folder removed meanwhile: a pruned checkpoint)
        top = Path(folder).relative_to(run_dir).parts[:1]
        for file in files:
            try:
                size = os.stat(os.path.join(folder, file)).st_size
            except OSError:
                continue
            part = top[0] if top else file
            sizes[part if part in PARTS else "other"] += size
    return sizes


def sample(run: Run, series: dict[tuple[str, int], Series], t: float, parts_roles: tuple[str, ...] = ()) -> None:
    """Each live process of the run (and the launcher) now; split by memory part for the roles `parts_roles`."""
    for name, pid in [("launcher", run.proc.pid), *run.pids().items()]:
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                point = (t, proc.memory_info().rss, proc.num_fds(), proc.num_threads())
            parts = memory_parts(pid) if role_of(name) in parts_roles else None
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        if point[1] == 0 or point[2] == 0:
            continue  # a process killed mid-exit: its memory and files already released, not yet a zombie
        s = series.setdefault((name, pid), Series(role_of(name), name, pid))
        s.samples.append(point)
        if parts is not None:
            s.parts.append((t, parts))


def growth(
    series: list[Series], warmup_s: float, own_warmup_s: float, min_span_s: float, age_s: float
) -> dict[str, Any]:
    """Each role's growth per hour (module docstring), with what it rests on: the processes fitted and their
    minutes of samples. A role none of whose processes lived long enough gets `processes` 0 and no figure (None),
    never 0.0: a figure that rests on nothing is not a flat one."""
    out: dict[str, Any] = {}
    for role in sorted({s.role for s in series}):
        mine = [s for s in series if s.role == role]
        per: list[dict[str, float]] = []
        for s in mine:
            start = max(warmup_s, s.samples[0][0] + own_warmup_s)
            kept = [p for p in s.samples if p[0] >= start]
            if len(kept) < 3 or kept[-1][0] - kept[0][0] < min_span_s:
                continue
            rss_mb_h = slope_per_hour([(t, rss / MB) for t, rss, _, _ in kept])
            kept_parts = [(t, p) for t, p in s.parts if t >= start]
            per.append({
                "parts": {k: slope_per_hour([(t, p[k] / MB) for t, p in kept_parts]) for k in MEMORY_PARTS}
                if len(kept_parts) >= 3 else None,
                "rss_mb_per_h": rss_mb_h,
                "rss_pct_per_h": 100 * rss_mb_h / (statistics.mean(rss for _, rss, _, _ in kept) / MB),
                "fds_per_h": slope_per_hour([(t, fds) for t, _, fds, _ in kept]),
                "threads_per_h": slope_per_hour([(t, th) for t, _, _, th in kept]),
                "span_s": kept[-1][0] - kept[0][0],
                "fds_range": [min(p[2] for p in kept), max(p[2] for p in kept)],
                "threads_range": [min(p[3] for p in kept), max(p[3] for p in kept)],
            })  # fmt: skip
        figures: dict[str, Any] = dict.fromkeys([*(f"{k}_{w}" for k in RATES for w in WHICH), *RANGES])
        if per:
            figures = {
                **{f"{k}_median": statistics.median(p[k] for p in per) for k in RATES},
                **{f"{k}_worst": max(p[k] for p in per) for k in RATES},
                "fds_range": [min(p["fds_range"][0] for p in per), max(p["fds_range"][1] for p in per)],
                "threads_range": [min(p["threads_range"][0] for p in per), max(p["threads_range"][1] for p in per)],
            }
        split = [p["parts"] for p in per if p["parts"] is not None]
        if split:
            figures["rss_parts_mb_per_h"] = {
                k: {"median": statistics.median(p[k] for p in split), "worst": max(p[k] for p in split)}
                for k in MEMORY_PARTS
            }
        out[role] = {
            "processes": len(per),
            "process_minutes": sum(p["span_s"] for p in per) / 60,
            "processes_seen": len(mine),
            **figures,
            **rss_at_age(mine, age_s),
        }
    return out


def rss_at_age(series: list[Series], age_s: float) -> dict[str, Any]:
    """Whether a role's processes start bigger the later they start: each process's RSS at its own age `age_s`
    against when it started, as MB per hour of the soak. The one figure for a role whose processes are killed
    before their own warm-up ends (a leak a replacement inherits, from the fork server or a peer, shows here)."""
    points = []
    for s in series:
        at_age = [rss for t, rss, _, _ in s.samples if t >= s.samples[0][0] + age_s]
        if at_age:
            points.append((s.samples[0][0], at_age[0] / MB))
    points.sort()
    spread = len(points) >= 3 and points[-1][0] - points[0][0] > 0
    return {
        "rss_at_age_s": age_s,
        "rss_at_age_processes": len(points),
        "rss_at_age_mb_per_h": slope_per_hour(points) if spread else None,
        "rss_at_age_range_mb": [min(v for _, v in points), max(v for _, v in points)] if points else None,
    }


def dir_growth(points: list[tuple[float, int, dict[str, int]]], warmup_s: float) -> dict[str, float]:
    """Bytes a training iteration adds to each part of the run directory, after the warm-up."""
    kept = [(iterations, parts) for t, iterations, parts in points if t >= warmup_s]
    if len({i for i, _ in kept}) < 2:
        return {}
    return {part: slope_per_hour([(i, p[part]) for i, p in kept]) / 3600 for part in kept[0][1]}


def checks(rows: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    iterations = [r["iteration"] for r in rows]
    training = [r for r in rows if "rollout/episodes" in r]
    mismatches = [r["iteration"] for r in rows for k, v in r.items() if k.endswith("/version_mismatch") and v]
    uncounted = [r["iteration"] for r in training if r["rollout/episodes"] + r["rollout/dropped"] != batch]
    return {
        "iterations": len(rows),
        "every_iteration_once": iterations == list(range(len(rows))),
        "version_mismatch_zero": not mismatches,
        "no_episode_uncounted": not uncounted,
        "restarts": {role: sum(r.get(f"faults/restarts/{role}", 0) for r in rows) for role in (*KILLED, *ONCE)},
        "bad_rows": {"version_mismatch": mismatches[:10], "uncounted": uncounted[:10]},
    }


def _newest_checkpoint(run_dir: Path) -> int:
    """The newest version the router has checkpointed (complete for every policy), or -1."""
    versions = [int(p.stem[1:]) for p in (run_dir / "checkpoints" / "router").glob("v*.json")]
    return max(versions, default=-1)


def _kill(pid: int) -> bool:
    """SIGKILL `pid`; False when it is gone already (a whole-run restart under way: its pids.json is old)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def soak(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from mas_async.config import load_config

    config = load_config(args.config, [*SETTINGS, *args.overrides])
    rng = random.Random(args.seed)
    run = Run(work / "run", None, *SETTINGS, *args.overrides, config=Path(args.config).resolve())
    duration = 60 * args.minutes
    # The trainer in the first half, the router in the second: a whole-run restart needs a checkpoint newer than
    # the one it restarted from before the next (the launcher stops a run whose fault recurs before one).
    once = {"trainer": rng.uniform(0.2, 0.35) * duration, "router": rng.uniform(0.6, 0.75) * duration}
    restarted_at: int | None = None
    """The newest complete checkpoint when the last trainer or router was killed."""
    series: dict[tuple[str, int], Series] = {}
    dir_points: list[tuple[float, int, dict[str, int]]] = []
    kills: list[dict[str, Any]] = []
    try:
        run.wait("the first row", lambda: len(run.rows()) >= 1, timeout_s=600)
        start = time.monotonic()
        next_kill, next_sample = start + args.kill_every, start
        while (now := time.monotonic()) - start < duration:
            if run.proc.poll() is not None:
                run.log.flush()
                tail = "\n".join(Path(run.log.name).read_text(errors="replace").splitlines()[-40:])
                raise RuntimeError(f"the run stopped (status {run.proc.returncode}); its output ends:\n{tail}")
            if now >= next_sample:
                sample(run, series, now - start, args.parts_roles)
                dir_points.append((now - start, len(run.rows()), dir_parts(run.dir)))
                next_sample += args.sample_s
            due = [kind for kind, at in once.items() if now - start >= at]
            if due and restarted_at is not None and _newest_checkpoint(run.dir) <= restarted_at:
                due = []  # (not yet: the run has not checkpointed since the last whole-run restart)
            if now >= next_kill or due:
                kind = due[0] if due else rng.choice(KILLED)
                names = sorted(n for n in run.pids() if role_of(n) == kind)
                name = rng.choice(names) if names else None
                if name is not None and run.joined(name, pid := run.pids()[name]) and _kill(pid):
                    kills.append({"at_s": now - start, "name": name, "pid": pid})
                    if due:
                        del once[kind]
                        restarted_at = _newest_checkpoint(run.dir)
                    else:
                        next_kill += args.kill_every
            time.sleep(0.2)
        finished = finish(run, args.finish_timeout_s)
        rows = run.rows()
    finally:
        run.stop()
    warmup = 60 * args.warmup_min
    return {
        "config": shown_path(args.config),
        "overrides": args.overrides,
        "minutes": args.minutes,
        "kill_every_s": args.kill_every,
        "warmup_min": args.warmup_min,
        "min_span_s": args.min_span_s,
        "kills": kills,
        "own_warmup_min": args.own_warmup_min,
        "growth": growth(list(series.values()), warmup, 60 * args.own_warmup_min, args.min_span_s, args.age_s),
        "dir_bytes_per_iteration": dir_growth(dir_points, warmup),
        "dir_bytes_at_end": dir_points[-1][2] if dir_points else {},
        "checks": {**checks(rows, config.rollout.batch_size), **finished},
        "samples": [
            {
                "role": s.role,
                "name": s.name,
                "pid": s.pid,
                "samples": s.samples,
                **({"parts": s.parts} if s.parts else {}),
            }
            for s in series.values()
        ],
    }


def finish(run: Run, timeout_s: float) -> dict[str, Any]:
    """End the run as a user (or SLURM) does: ask it to stop at its next checkpoint (stop_request.py) and wait,
    at most `timeout_s`, for the launcher to exit by itself. Returns whether it did, with status 0, and how long
    it took."""
    from mas_async.router.stop_request import request_stop

    t0 = time.monotonic()
    request_stop(run.dir, "the soak's time is up")
    while run.proc.poll() is None and time.monotonic() - t0 < timeout_s:
        time.sleep(0.5)
    status = run.proc.poll()
    return {"finished_by_itself": status == 0, "exit_status": status, "finish_s": round(time.monotonic() - t0, 1)}


def report(result: dict[str, Any]) -> list[str]:
    lines = [
        f"soak of {result['config']} {' '.join(result['overrides'])}: {result['minutes']:g} min, a kill every "
        f"{result['kill_every_s']:g} s ({len(result['kills'])} kills), figures after the first {result['warmup_min']:g} min "
        f"and each process's own first {result['own_warmup_min']:g} min",
        "role        procs (minutes)  RSS MB/h (median, worst)  RSS %/h (median, worst)  fds/h (worst)  threads/h "
        "(worst)  fds  threads  | RSS at own age (procs, MB/h of start time, range)",
    ]
    for role, g in result["growth"].items():
        at_age = _at_age(g)
        if not g["processes"]:
            lines.append(
                f"{role:<11} {0:>5} {0:>9}  no figure: none of its {g['processes_seen']} processes was sampled "
                f"{result['min_span_s']:g} s past its own first {result['own_warmup_min']:g} min and the soak's"
                f"  | {at_age}"
            )
            continue
        lines.append(
            f"{role:<11} {g['processes']:>5} {g['process_minutes']:>9.1f}  {g['rss_mb_per_h_median']:>+8.2f} "
            f"{g['rss_mb_per_h_worst']:>+8.2f}        {g['rss_pct_per_h_median']:>+7.2f} {g['rss_pct_per_h_worst']:>+7.2f}"
            f"         {g['fds_per_h_worst']:>+7.1f}        {g['threads_per_h_worst']:>+7.1f}       "
            f"{g['fds_range'][0]}-{g['fds_range'][1]}  {g['threads_range'][0]}-{g['threads_range'][1]}  | {at_age}"
        )
        if g.get("rss_parts_mb_per_h"):
            lines.append(
                f"{'':<11} RSS MB/h by part (median, worst): "
                + ", ".join(f"{k} {v['median']:+.2f}, {v['worst']:+.2f}" for k, v in g["rss_parts_mb_per_h"].items())
            )
    per_iteration = result["dir_bytes_per_iteration"]
    if per_iteration:
        lines.append(
            "run directory, bytes per iteration: " + ", ".join(f"{k} {v:,.0f}" for k, v in per_iteration.items())
        )
    c = result["checks"]
    lines.append(
        f"checks: {c['iterations']} iterations; every iteration once: {c['every_iteration_once']}; version_mismatch "
        f"0: {c['version_mismatch_zero']}; no episode uncounted: {c['no_episode_uncounted']}; restarts {c['restarts']}; "
        f"finished by itself (asked to stop at a checkpoint): {c['finished_by_itself']} "
        f"(status {c['exit_status']}, {c['finish_s']:g} s)"
    )
    return lines


def _at_age(g: dict[str, Any]) -> str:
    slope = g["rss_at_age_mb_per_h"]
    text = f"{g['rss_at_age_s']:g} s: {g['rss_at_age_processes']} procs, "
    text += f"{slope:+.2f} MB/h" if slope is not None else "no slope"
    low_high = g["rss_at_age_range_mb"]
    return text + (f", {low_high[0]:.0f}-{low_high[1]:.0f} MB" if low_high else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", help="the run's config (e.g. configs/plan_path_tiny.yaml)")
    p.add_argument("overrides", nargs="*", help="config overrides, key=value (e.g. cluster.leases=true)")
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--kill-every", type=float, default=60.0, help="seconds between kills of an env worker or replica")
    p.add_argument("--warmup-min", type=float, default=10.0, help="minutes left out of the growth figures")
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument(
        "--own-warmup-min", type=float, default=10.0, help="each process's own first minutes left out of its growth"
    )
    p.add_argument("--min-span-s", type=float, default=300.0, help="the least a process is sampled after the warm-ups")
    p.add_argument("--age-s", type=float, default=120.0, help="the own age at which processes' RSS is compared")
    p.add_argument(
        "--parts-roles",
        type=lambda v: tuple(r for r in v.split(",") if r),
        default=("trainer", "router", "launcher"),
        help="roles whose RSS is split by memory part (comma-separated; empty for none)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--finish-timeout-s", type=float, default=600.0, help="the most the run may take to stop at its checkpoint"
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--keep", type=Path, help="a new folder for the run (kept; default a temporary one, removed)")
    p.add_argument("--smoke", action="store_true", help="1 minute, a kill every 12 s: the tests' run")
    args = p.parse_intermixed_args(argv)  # (overrides may follow the options, as the docstring's commands do)
    if args.smoke:
        args.minutes, args.kill_every, args.warmup_min, args.sample_s = 1.0, 12.0, 0.25, 1.5
        args.own_warmup_min, args.min_span_s, args.age_s = 5 / 60, 10.0, 5.0
        args.overrides = ["rollout.batch_size=4", "algorithm.k=4", "trainer.checkpoint_every=2", *args.overrides]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.keep is not None:  # the run's directory (logs, metrics, checkpoints) kept for a look afterwards
        args.keep.mkdir(parents=True, exist_ok=False)
        result = soak(args, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="soak-") as work:
            result = soak(args, Path(work))
    print("\n".join(report(result)))
    if args.json:
        args.json.write_text(json.dumps(result))
    c = result["checks"]
    ok = c["every_iteration_once"] and c["version_mismatch_zero"] and c["no_episode_uncounted"]
    return 0 if ok and c["finished_by_itself"] else 1


if __name__ == "__main__":
    sys.exit(main())
