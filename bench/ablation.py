"""The papers' Plan-Path ablation on CPU with the built-in tiny model, through `mas-async train`.

Rows (each over several seeds; success = mean held-out `eval/team_success_rate` of the last 3 evaluations):
- single agent + GRPO            (one agent makes every move; parallel sampling, trajectory groups)
- multi-agent + GRPO             (two role-specialised agents; parallel sampling, trajectory groups)
- multi-agent + AT-GRPO          (tree sampling, agent- and turn-wise groups)
- multi-agent + AT-GRPO + per-agent std (Dr. MAS's per-agent scale on AT-GRPO's groups: tree sampling,
  grouping=agent_turn, std_scope=agent; A = (r - group mean) / agent k's own std)
plus the role-swap probe: the AT-GRPO run's two trained policies evaluated with their roles swapped.

    python bench/ablation.py                      # 3 seeds x 200 iterations (about 40 min on 2 cores)
    python bench/ablation.py --seeds 0 --iterations 20 --out /tmp/ablation   # a quick look
    python bench/ablation.py --smoke              # 2 iterations per row: checks the plumbing only
    python bench/ablation.py --variants at-grpo-agent-std --iterations 100   # one row (ids: --help)

Prints a markdown table (mean and spread over seeds) and writes OUT/ablation.json and OUT/ablation.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name (the table row; the run directories are named after it) -> (config, overrides); VARIANT_IDS names
# them on the command line.
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "single agent + GRPO": (
        "configs/plan_path_tiny_single.yaml",
        ["algorithm.sampling=parallel", "algorithm.grouping=trajectory"],
    ),
    "multi-agent + GRPO": (
        "configs/plan_path_tiny.yaml",
        ["algorithm.sampling=parallel", "algorithm.grouping=trajectory"],
    ),
    "multi-agent + AT-GRPO": ("configs/plan_path_tiny.yaml", []),
    # grouping=agent would pool each agent's candidates of all turns of the one tree-sampled episode into
    # one baseline (refused by the config); Dr. MAS's per-agent scale composes with AT-GRPO's groups.
    "multi-agent + AT-GRPO + per-agent std": (
        "configs/plan_path_tiny.yaml",
        ["algorithm.grouping=agent_turn", "algorithm.std_scope=agent"],
    ),
}
VARIANT_IDS = dict(zip(["single-grpo", "multi-grpo", "at-grpo", "at-grpo-agent-std"], VARIANTS, strict=True))
AT_GRPO = "multi-agent + AT-GRPO"


def run(command: list[str], log: Path) -> None:
    with log.open("w") as f:
        code = subprocess.call(
            [sys.executable, "-m", "mas_async", *command], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT
        )
    if code != 0:
        raise SystemExit(f"ablation: `mas-async {' '.join(command)}` failed (status {code}); see {log}")


def final_success(run_dir: Path, last: int = 3) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/team_success_rate"] for r in rows if "eval/team_success_rate" in r]
    return statistics.fmean(evals[-last:])


def role_swap(run_dir: Path, out: Path, iterations: int, eval_size: int) -> float:
    ckpt = run_dir / "checkpoints"
    version = f"v{iterations:06d}"
    swap_dir = out / f"{run_dir.name}-swapped"
    run(
        [
            "eval", "configs/plan_path_tiny.yaml", f"run.output_dir={swap_dir}", f"eval.size={eval_size}",
            f"eval.weights.vertical={ckpt / 'horizontal' / version}",
            f"eval.weights.horizontal={ckpt / 'vertical' / version}",
        ],
        out / f"{run_dir.name}-swapped.log",
    )  # fmt: skip
    return json.loads((swap_dir / "eval.json").read_text())["eval/team_success_rate"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--eval-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "ablation")
    parser.add_argument("--smoke", action="store_true", help="2 iterations, 1 seed, tiny batches")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANT_IDS),
        default=list(VARIANT_IDS),
        help="rows to run (default: all): " + "; ".join(f"{key} = {name}" for key, name in VARIANT_IDS.items()),
    )
    args = parser.parse_args()
    selected = {VARIANT_IDS[key]: VARIANTS[VARIANT_IDS[key]] for key in args.variants}
    if args.smoke:
        args.seeds, args.iterations, args.eval_size = [0], 2, 4
    args.out.mkdir(parents=True, exist_ok=True)
    extra = ["rollout.batch_size=4", "algorithm.k=4"] if args.smoke else []

    results: dict[str, list[float]] = {name: [] for name in selected}
    swapped: list[float] = []
    for seed in args.seeds:
        for name, (config, overrides) in selected.items():
            run_dir = args.out / f"{name.replace(' ', '_').replace('+', 'p')}-seed{seed}"
            if (
                not (run_dir / "metrics.jsonl").exists()
                or len([1 for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]) <= args.iterations
            ):
                run(
                    [
                        "train", config, *overrides, *extra, f"run.seed={seed}", f"run.iterations={args.iterations}",
                        f"run.output_dir={run_dir}", f"eval.size={args.eval_size}", "eval.every=5",
                    ],
                    args.out / f"{run_dir.name}.log",
                )  # fmt: skip
            results[name].append(final_success(run_dir))
            print(f"seed {seed}  {name:<42} success {results[name][-1]:.3f}", flush=True)
            if name == AT_GRPO:
                swapped.append(role_swap(run_dir, args.out, args.iterations, args.eval_size))
                print(f"seed {seed}  {'  role-swapped policies':<42} success {swapped[-1]:.3f}", flush=True)

    table = dict(results, **({"AT-GRPO policies with roles swapped": swapped} if swapped else {}))
    print(f"\nPlan-Path, tiny model, {args.iterations} iterations, seeds {args.seeds}; held-out success:\n")
    print("| variant | success (mean) | spread (min-max) | per seed |")
    print("|---|---|---|---|")
    for name, values in table.items():
        per_seed = ", ".join(f"{v:.2f}" for v in values)
        print(f"| {name} | {statistics.fmean(values):.3f} | {min(values):.2f}-{max(values):.2f} | {per_seed} |")
    (args.out / "ablation.json").write_text(json.dumps({"iterations": args.iterations, "seeds": args.seeds, **table}))
    plot(table, args.out / "ablation.png")


def plot(table: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    fig, ax = plt.subplots(figsize=(9, 4))
    means = [statistics.fmean(table[n]) for n in names]
    ax.barh(names, means, color="#4c72b0")
    for i, name in enumerate(names):
        ax.scatter(table[name], [i] * len(table[name]), color="black", s=12, zorder=3)
    ax.set_xlim(0, 1)
    ax.set_xlabel("held-out team success (bars: mean over seeds; dots: seeds)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
