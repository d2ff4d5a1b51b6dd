"""Learning under bounded staleness: the Plan-Path demo with `rollout.max_staleness` k = 0, 1, 2.

Each (k, seed) is one `mas-async train configs/plan_path_tiny.yaml` run, one after another (never two
at once: the comparison is in wall time). From each run's metrics.jsonl: held-out success at every
evaluation against the run's elapsed time and against iterations. Printed per k (over seeds): final
success (mean of the last 3 evaluations), wall time, iterations per minute, and the wall time at which
the run first reached the strict runs' final success (3-evaluation moving average), "-" if it never did.
The mode is worth keeping only if k=1 reaches that level in less wall time than k=0.

    python bench/staleness_learning.py                          # 3 seeds x k = 0, 1, 2 (about 50 min)
    python bench/staleness_learning.py --seeds 0 --iterations 50 --out /tmp/sl   # a quick look
    python bench/staleness_learning.py --smoke                  # 2 iterations each: the plumbing only

Writes OUT/staleness_learning.json and OUT/staleness_learning.png (success vs wall time, vs iterations).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/plan_path_tiny.yaml"
SMOKE = ["rollout.batch_size=4", "eval.every=1", "eval.size=4", "algorithm.k=4"]
"""Overrides of a --smoke run: small batches and an evaluation every iteration, so that 2 iterations
produce a curve."""


def train(run_dir: Path, seed: int, iterations: int, overrides: list[str], name: str) -> None:
    """One `mas-async train CONFIG` run into `run_dir` (its output to `run_dir`.log); `name` says which
    run failed."""
    command = [
        sys.executable, "-m", "mas_async", "train", CONFIG, f"run.output_dir={run_dir}", f"run.seed={seed}",
        f"run.iterations={iterations}", "trainer.checkpoint_every=0", *overrides,
    ]  # fmt: skip
    log = run_dir.with_suffix(".log")
    with log.open("w") as f:
        code = subprocess.call(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=3600)
    if code != 0:
        raise SystemExit(f"{name} failed (status {code}); see {log}")


def curve(run_dir: Path) -> dict[str, list[float]]:
    """Every evaluation of a run: its iteration, elapsed seconds and held-out success."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/team_success_rate" in r]
    return {
        "iteration": [r["iteration"] for r in evals],
        "elapsed_s": [r["time/elapsed_s"] for r in evals],
        "success": [r["eval/team_success_rate"] for r in evals],
        "wall_s": rows[-1]["time/elapsed_s"],
        "iterations": rows[-1]["iteration"],
    }


def time_to(c: dict, target: float, window: int = 3) -> float | None:
    """Elapsed seconds at which the moving average of `window` evaluations first reaches `target`."""
    s = c["success"]
    for i in range(window - 1, len(s)):
        if statistics.fmean(s[i - window + 1 : i + 1]) >= target:
            return c["elapsed_s"][i]
    return None


def final(c: dict, last: int = 3) -> float:
    return statistics.fmean(c["success"][-last:])


def summarise(curves: dict[int, list[dict]]) -> dict[int, dict]:
    strict = curves.get(0) or next(iter(curves.values()))
    target = statistics.fmean(final(c) for c in strict)
    table = {}
    for k, runs in curves.items():
        reached = [time_to(c, target) for c in runs]
        table[k] = {
            "final_success": [final(c) for c in runs],
            "wall_s": [c["wall_s"] for c in runs],
            "iterations_per_min": [60 * c["iterations"] / c["wall_s"] for c in runs],
            "time_to_strict_final_s": reached,
            "target": target,
        }
    return table


def fmt(values: list) -> str:
    """Mean (min-max) of the known values, and how many are None ("never")."""
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    mean = statistics.fmean(known)
    missing = len(values) - len(known)
    return f"{mean:.3g} ({min(known):.3g}-{max(known):.3g})" + (f", {missing} never" if missing else "")


def plot(curves: dict[str, list[dict]], path: Path, legend: str, title: str) -> None:
    """Success against wall time and against iterations, one colour per arm (the keys of `curves`, in
    order), one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_iter) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for n, (arm, runs) in enumerate(curves.items()):
        for i, c in enumerate(runs):
            label = arm if i == 0 else None
            by_time.plot([t / 60 for t in c["elapsed_s"]], c["success"], color=f"C{n}", alpha=0.7, label=label)
            by_iter.plot(c["iteration"], c["success"], color=f"C{n}", alpha=0.7, label=label)
    by_time.set_xlabel("wall time (min)")
    by_iter.set_xlabel("iteration")
    by_time.set_ylabel("held-out team success")
    by_time.legend(title=legend)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "staleness_learning")
    parser.add_argument("--smoke", action="store_true", help="2 iterations per run, k = 0 and 1, one seed")
    args = parser.parse_args()
    extra: list[str] = []
    if args.smoke:
        args.ks, args.seeds, args.iterations = [0, 1], [0], 2
        extra = SMOKE
    args.out.mkdir(parents=True, exist_ok=True)
    curves: dict[int, list[dict]] = {}
    for seed in args.seeds:  # interleaved, so that a slow stretch of the machine hits every k alike
        for k in args.ks:
            run_dir = args.out / f"k{k}-seed{seed}"
            train(
                run_dir,
                seed,
                args.iterations,
                [f"rollout.max_staleness={k}", *extra],
                f"staleness_learning: k={k} seed={seed}",
            )
            curves.setdefault(k, []).append(curve(run_dir))
            print(f"k={k} seed={seed}: final {final(curves[k][-1]):.3f} in {curves[k][-1]['wall_s']:.0f} s", flush=True)
    table = summarise(curves)
    target = next(iter(table.values()))["target"]
    print(f"\n| k | final success | wall s | iterations/min | s to strict's final ({target:.3f}) |")
    print("|---|---|---|---|---|")
    for k, row in table.items():
        print(
            f"| {k} | {fmt(row['final_success'])} | {fmt(row['wall_s'])} | {fmt(row['iterations_per_min'])} "
            f"| {fmt(row['time_to_strict_final_s'])} |"
        )
    (args.out / "staleness_learning.json").write_text(json.dumps({"curves": curves, "table": table}, indent=1))
    by_k = {f"k={k}": runs for k, runs in curves.items()}
    title = "Plan-Path demo: strict (k=0) against bounded staleness, one line per seed"
    plot(by_k, args.out / "staleness_learning.png", "max_staleness", title)
    print(f"\nwrote {args.out / 'staleness_learning.json'} and {args.out / 'staleness_learning.png'}")


if __name__ == "__main__":
    main()
