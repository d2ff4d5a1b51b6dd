"""The papers' Plan-Path ablation on CPU with the built-in tiny model, through `mas-async train`.

Rows (each over several seeds; success = mean held-out `eval/team_success_rate` of the last 3 evaluations):
- single agent + GRPO            (one agent makes every move; parallel sampling, trajectory groups)
- multi-agent + GRPO             (two role-specialised agents; parallel sampling, trajectory groups)
- multi-agent + AT-GRPO          (tree sampling, agent- and turn-wise groups)
- multi-agent + AT-GRPO + per-agent std (Dr. MAS's per-agent scale on AT-GRPO's groups: tree sampling,
  grouping=agent_turn, std_scope=agent; A = (r - group mean) / agent k's own std)
- shared policy + AT-GRPO + per-agent std (the same team, one policy serving both agents: role-sharing)
- single agent + AT-GRPO         (one agent makes every move, tree sampling: the team's algorithm alone)
plus the role-swap probe: the AT-GRPO run's two trained policies evaluated with their roles swapped.

`--team toolplan`: Stronger-MAS's own two probes for its tool + plan team on Plan-Path (the paper:
jointly trained 96, roles trained as single agents then combined 16, roles swapped 6; Qwen3-1.7B):
- tool + plan, trained jointly (AT-GRPO on `--toolplan-config`)
- tool alone and plan alone, each trained as a single agent (envs `plan_path_tool_alone`,
  `plan_path_plan_alone`: the same config with one role), then the two policies combined in the team
- the jointly trained policies with their roles swapped
On CPU the tiny model cannot write programs, so these rows check the plumbing; the figures need the GPU
config (`--toolplan-config configs/plan_path_qwen3_1.7b.yaml`).

    python bench/ablation.py                      # 3 seeds x 200 iterations (about 40 min on 2 cores)
    python bench/ablation.py --seeds 0 --iterations 20 --out /tmp/ablation   # a quick look
    python bench/ablation.py --smoke              # 1 iteration per row: checks the plumbing only
    python bench/ablation.py --variants at-grpo-agent-std --iterations 100   # one row (ids: --help)
    python bench/ablation.py --team toolplan --smoke                         # the tool + plan probes

Prints a markdown table (mean and spread over seeds) and writes OUT/ablation.json and OUT/ablation.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

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
    # The papers' team-versus-single-agent comparison on one algorithm (AT-GRPO, tree sampling): the team with
    # a policy per agent (the row above), the team sharing one policy, one agent making every move.
    "shared policy + AT-GRPO + per-agent std": (
        "configs/plan_path_tiny_shared.yaml",
        ["algorithm.grouping=agent_turn", "algorithm.std_scope=agent"],
    ),
    "single agent + AT-GRPO": ("configs/plan_path_tiny_single.yaml", []),
}
VARIANT_IDS = dict(
    zip(
        ["single-grpo", "multi-grpo", "at-grpo", "at-grpo-agent-std", "shared-at-grpo-agent-std", "single-at-grpo"],
        VARIANTS,
        strict=True,
    )
)
AT_GRPO = "multi-agent + AT-GRPO"
TOOLPLAN_ROWS = (
    "tool + plan, trained jointly (AT-GRPO)",
    "tool alone, trained as a single agent",
    "plan alone, trained as a single agent",
    "tool + plan, each trained alone, then combined",
    "tool + plan, jointly trained, roles swapped",
)


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


def train(config: str, run_dir: Path, args: argparse.Namespace, seed: int, overrides: list[str]) -> float:
    """Train `config` into `run_dir` (unless a finished run is there); its final held-out success."""
    rows = run_dir / "metrics.jsonl"
    if not rows.exists() or len([1 for line in rows.read_text().splitlines() if line]) <= args.iterations:
        extra = ["rollout.batch_size=4", "algorithm.k=4"] if args.smoke else []
        run(
            [
                "train", config, *overrides, *extra, f"run.seed={seed}", f"run.iterations={args.iterations}",
                f"run.output_dir={run_dir}", f"eval.size={args.eval_size}", "eval.every=5",
                f"eval.baseline_draws={args.baseline_draws}",
            ],
            run_dir.parent / f"{run_dir.name}.log",
        )  # fmt: skip
    return final_success(run_dir)


def evaluate(config: str, weights: dict[str, Path], out_dir: Path, eval_size: int) -> float:
    """Held-out success of the team of `config` playing with the given weights (agent -> checkpoint)."""
    run(
        [
            "eval", config, f"run.output_dir={out_dir}", f"eval.size={eval_size}",
            *(f"eval.weights.{agent}={path}" for agent, path in weights.items()),
        ],
        out_dir.parent / f"{out_dir.name}.log",
    )  # fmt: skip
    return json.loads((out_dir / "eval.json").read_text())["eval/team_success_rate"]


def checkpoint(run_dir: Path, policy: str, iterations: int) -> Path:
    return run_dir / "checkpoints" / policy / f"v{iterations:06d}"


def role_swap(run_dir: Path, out: Path, iterations: int, eval_size: int) -> float:
    swapped = {"vertical": checkpoint(run_dir, "horizontal", iterations)}
    swapped["horizontal"] = checkpoint(run_dir, "vertical", iterations)
    return evaluate("configs/plan_path_tiny.yaml", swapped, out / f"{run_dir.name}-swapped", eval_size)


def alone_config(team_config: str, role: str, out: Path) -> str:
    """The team config with `role` alone: its agent and policy only, on the env where it plays alone."""
    raw = yaml.safe_load((ROOT / team_config).read_text())
    if raw["env"]["name"] != "plan_path_toolplan" or set(raw["agents"]) != {"tool", "plan"}:
        raise SystemExit(f"ablation: {team_config} is not a Plan-Path tool + plan team (agents tool and plan)")
    policy = raw["agents"][role]["policy"]
    raw["agents"] = {role: {**raw["agents"][role], "node": f"plan_path_{role}_alone"}}
    raw["policies"] = {policy: raw["policies"][policy]}
    raw["env"]["name"] = f"plan_path_{role}_alone"
    raw["run"]["name"] = f"{raw['run'].get('name', 'toolplan')}-{role}-alone"
    path = out / f"{Path(team_config).stem}-{role}-alone.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def toolplan_probes(args: argparse.Namespace) -> dict[str, list[float]]:
    """Stronger-MAS's probes for the tool + plan team (see the module docstring), per seed."""
    config = args.toolplan_config
    raw = yaml.safe_load((ROOT / config).read_text())
    policy = {role: raw["agents"][role]["policy"] for role in ("tool", "plan")}
    alone = {role: alone_config(config, role, args.out) for role in ("tool", "plan")}
    table: dict[str, list[float]] = {name: [] for name in TOOLPLAN_ROWS}
    for seed in args.seeds:
        joint = args.out / f"toolplan-joint-seed{seed}"
        table[TOOLPLAN_ROWS[0]].append(train(config, joint, args, seed, []))
        alone_dirs = {role: args.out / f"toolplan-{role}-alone-seed{seed}" for role in ("tool", "plan")}
        table[TOOLPLAN_ROWS[1]].append(train(alone["tool"], alone_dirs["tool"], args, seed, []))
        table[TOOLPLAN_ROWS[2]].append(train(alone["plan"], alone_dirs["plan"], args, seed, []))
        combined = {role: checkpoint(alone_dirs[role], policy[role], args.iterations) for role in ("tool", "plan")}
        table[TOOLPLAN_ROWS[3]].append(
            evaluate(config, combined, args.out / f"toolplan-combined-seed{seed}", args.eval_size)
        )
        swapped = {
            "tool": checkpoint(joint, policy["plan"], args.iterations),
            "plan": checkpoint(joint, policy["tool"], args.iterations),
        }
        table[TOOLPLAN_ROWS[4]].append(
            evaluate(config, swapped, args.out / f"toolplan-swapped-seed{seed}", args.eval_size)
        )
        for name, values in table.items():
            print(f"seed {seed}  {name:<58} success {values[-1]:.3f}", flush=True)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--eval-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "ablation")
    parser.add_argument(
        "--baseline-draws", type=int, default=20, help="episodes of each reference policy per held-out problem"
    )
    parser.add_argument("--smoke", action="store_true", help="1 iteration, 1 seed, tiny batches")
    parser.add_argument("--team", choices=["movers", "toolplan"], default="movers", help="whose ablation to run")
    parser.add_argument(
        "--toolplan-config",
        default="configs/plan_path_toolplan_tiny.yaml",
        help="the tool + plan team of --team toolplan (the paper's setting: configs/plan_path_qwen3_1.7b.yaml)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANT_IDS),
        default=list(VARIANT_IDS),
        help="rows to run (default: all): " + "; ".join(f"{key} = {name}" for key, name in VARIANT_IDS.items()),
    )
    args = parser.parse_args()
    if args.smoke:
        args.seeds, args.iterations, args.eval_size, args.baseline_draws = [0], 1, 4, 2
    args.out.mkdir(parents=True, exist_ok=True)
    table = toolplan_probes(args) if args.team == "toolplan" else movers(args)
    model = args.toolplan_config if args.team == "toolplan" else "tiny model"
    print(f"\nPlan-Path ({model}), {args.iterations} iterations, seeds {args.seeds}; held-out success:\n")
    print("| variant | success (mean) | spread (min-max) | per seed |")
    print("|---|---|---|---|")
    for name, values in table.items():
        per_seed = ", ".join(f"{v:.2f}" for v in values)
        print(f"| {name} | {statistics.fmean(values):.3f} | {min(values):.2f}-{max(values):.2f} | {per_seed} |")
    (args.out / "ablation.json").write_text(json.dumps({"iterations": args.iterations, "seeds": args.seeds, **table}))
    plot(table, args.out / "ablation.png")


def movers(args: argparse.Namespace) -> dict[str, list[float]]:
    """The variants' rows and the role-swap probe for the movers team (see the module docstring)."""
    selected = {VARIANT_IDS[key]: VARIANTS[VARIANT_IDS[key]] for key in args.variants}
    results: dict[str, list[float]] = {name: [] for name in selected}
    swapped: list[float] = []
    for seed in args.seeds:
        for name, (config, overrides) in selected.items():
            run_dir = args.out / f"{name.replace(' ', '_').replace('+', 'p')}-seed{seed}"
            results[name].append(train(config, run_dir, args, seed, overrides))
            print(f"seed {seed}  {name:<42} success {results[name][-1]:.3f}", flush=True)
            if name == AT_GRPO:
                swapped.append(role_swap(run_dir, args.out, args.iterations, args.eval_size))
                print(f"seed {seed}  {'  role-swapped policies':<42} success {swapped[-1]:.3f}", flush=True)
    return dict(results, **({"AT-GRPO policies with roles swapped": swapped} if swapped else {}))


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
