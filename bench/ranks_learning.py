"""Learning with data-parallel trainer ranks: the Plan-Path demo with 1 against 2 trainer ranks per policy.

`policies.<p>.trainer_ranks=2` splits each step's batch over two trainer processes (DDP over gloo on the
CPU) whose update should equal one rank's on the same batch; this checks that the demo still learns as it
does with one rank. Each (arm, seed) is one `mas-async train configs/plan_path_tiny.yaml` run, one after
another (never two at once: the comparison is in wall time too), run by bench/staleness_learning.py's
`train`. Printed per arm (over seeds): held-out success of the first and of the last tenth of the
evaluations, final success (mean of the last 3 evaluations), wall time, iterations per minute, the wall
time at which the run first reached the 1-rank runs' final success ("-" if never), and the max over
iterations of each policy's `version_mismatch` (must stay 0) and `logprob_abs_diff` (trainer against
rollout log-probs of the same weights).

    python bench/ranks_learning.py                    # 2 seeds x 1, 2 ranks at the config's 300 iterations
    python bench/ranks_learning.py --seeds 0 --iterations 50 --out /tmp/rl   # a quick look
    python bench/ranks_learning.py --smoke            # 2 iterations each: the plumbing only

Writes OUT/ranks_learning.json and OUT/ranks_learning.png (success vs wall time, vs iterations).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.staleness_learning import CONFIG, ROOT, SMOKE, curve, final, fmt, plot, summarise, train
from mas_async.config import load_config

ARMS = {
    "1 rank": [],
    "2 ranks": ["policies.vertical.trainer_ranks=2", "policies.horizontal.trainer_ranks=2"],
}
POLICIES = ("vertical", "horizontal")
CHECKS = ("version_mismatch", "logprob_abs_diff", "logprob_abs_diff_max")
"""Trainer metrics whose max over a run's iterations is reported, per policy."""


def tenth(c: dict, last: bool) -> float:
    """Mean success of the first (or last) tenth of a run's evaluations, at least one."""
    n = max(1, len(c["success"]) // 10)
    return statistics.fmean(c["success"][-n:] if last else c["success"][:n])


def worst(run_dir: Path) -> dict[str, float]:
    """Max over the run's iterations of each policy's CHECKS, as `<policy>/<metric>`."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = {}
    for policy in POLICIES:
        for check in CHECKS:
            key = f"policy/{policy}/{check}"
            values = [r[key] for r in rows if key in r]
            if not values:
                raise SystemExit(f"ranks_learning: no {key} in {run_dir / 'metrics.jsonl'}")
            out[f"{policy}/{check}"] = max(values)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--iterations", type=int, default=load_config(ROOT / CONFIG).run.iterations)
    parser.add_argument("--out", type=Path, default=Path("/tmp/ranks_learning"))
    parser.add_argument("--smoke", action="store_true", help="2 iterations per run, one seed")
    args = parser.parse_args()
    extra: list[str] = []
    if args.smoke:
        args.seeds, args.iterations, extra = args.seeds[:1], 2, SMOKE
    args.out.mkdir(parents=True, exist_ok=True)
    curves: dict[str, list[dict]] = {}
    checks: dict[str, list[dict]] = {}
    for seed in args.seeds:  # interleaved, so that a slow stretch of the machine hits both arms alike
        for arm, overrides in ARMS.items():
            run_dir = args.out / f"ranks{arm.split()[0]}-seed{seed}"
            start = time.monotonic()
            train(run_dir, seed, args.iterations, [*overrides, *extra], f"ranks_learning: {arm} seed={seed}")
            c, w = curve(run_dir), worst(run_dir)
            c["process_s"] = time.monotonic() - start  # with start-up and shutdown, which time/elapsed_s lacks
            curves.setdefault(arm, []).append(c)
            checks.setdefault(arm, []).append(w)
            print(
                f"{arm} seed={seed}: success first tenth {tenth(c, False):.4f}, last tenth {tenth(c, True):.4f}, "
                f"final {final(c):.4f}, {c['iterations']} iterations in {c['wall_s']:.1f} s "
                f"({c['process_s']:.1f} s with start-up); max " + ", ".join(f"{k} {v:.4g}" for k, v in w.items()),
                flush=True,
            )
    table = summarise(curves)
    for arm, row in table.items():
        row["time_to_1_rank_final_s"] = row.pop("time_to_strict_final_s")
        row["first_tenth_success"] = [tenth(c, False) for c in curves[arm]]
        row["last_tenth_success"] = [tenth(c, True) for c in curves[arm]]
        row["max"] = {key: [w[key] for w in checks[arm]] for key in checks[arm][0]}
    target = next(iter(table.values()))["target"]
    keys = list(next(iter(table.values()))["max"])
    print(
        f"\n| arm | success first tenth | last tenth | final | wall s | iterations/min | s to 1 rank's final "
        f"({target:.3f}) | " + " | ".join(f"max {k}" for k in keys) + " |"
    )
    print("|---" * (7 + len(keys)) + "|")
    for arm, row in table.items():
        print(
            f"| {arm} | {fmt(row['first_tenth_success'])} | {fmt(row['last_tenth_success'])} "
            f"| {fmt(row['final_success'])} | {fmt(row['wall_s'])} | {fmt(row['iterations_per_min'])} "
            f"| {fmt(row['time_to_1_rank_final_s'])} | " + " | ".join(fmt(row["max"][k]) for k in keys) + " |"
        )
    (args.out / "ranks_learning.json").write_text(json.dumps({"curves": curves, "table": table}, indent=1))
    title = "Plan-Path demo: 1 against 2 trainer ranks per policy, one line per seed"
    plot(curves, args.out / "ranks_learning.png", "trainer ranks", title)
    print(f"\nwrote {args.out / 'ranks_learning.json'} and {args.out / 'ranks_learning.png'}")


if __name__ == "__main__":
    main()
