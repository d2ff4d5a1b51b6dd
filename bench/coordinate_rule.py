"""What a rule that reads only the coordinates scores on a Plan-Path run's held-out problems, beside the env's
reference policies and the run's trained figure.

The coordinate rule plays what a policy that compares two numbers would: the vertical mover steps toward
G's row while A's row differs from it, the horizontal mover toward G's column while A's column differs,
and each plays a fixed move (`coordinates_<V>_<H>`: V for the vertical mover, H for the horizontal one)
once aligned. It never looks at the walls. Every policy plays the run's own workflow and nodes on the
run's held-out problems (`mas_async.held_out.run_problems` with the config's sizes and options), as the
run's baselines are played, and its figure is its expectation (`mas_async.rollout.baseline`): exact where
its random choices can be enumerated (random's included, on short episodes), else the mean of enough
draws for a standard error of at most 0.005. The trained figures are the last evaluation of each
results folder given.

    python -m bench.coordinate_rule                     # the SmolLM2 grid run (results/smollm2_grid-seed*)
    python -m bench.coordinate_rule --json results/bench/coordinate_rule-smollm2_grid.json
    python -m bench.coordinate_rule --run results/demo-seed0 --trained results/demo-seed0 results/demo-seed1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
from pathlib import Path
from typing import Any

from mas_async.api import ReferencePolicy
from mas_async.api.registry import ENVS, NODES, WORKFLOWS, resolve
from mas_async.config import Config, load_config
from mas_async.held_out import run_problems
from mas_async.machine_paths import without_machine_paths
from mas_async.rollout.baseline import BaselineEpisode, ExpectedBaselines, PlayOnce, draws_per_episode, exact_paths

ROOT = Path(__file__).resolve().parents[1]
RUN = "results/smollm2_grid-seed0"
SEEDS = ["results/smollm2_grid-seed0", "results/smollm2_grid-seed1"]
AXES = {"vertical": (0, {-1: "U", 1: "D"}), "horizontal": (1, {-1: "L", 1: "R"})}


def coordinate_rule(vertical: str, horizontal: str) -> ReferencePolicy:
    """Toward G on the mover's own axis from A's and G's coordinates alone; `vertical` / `horizontal` once
    aligned."""

    def rule(env: Any, agent: str, rng: random.Random) -> str:
        axis, toward = AXES[agent]
        gap = env.goal[axis] - env.position[axis]
        if gap:
            return toward[1 if gap > 0 else -1]
        return vertical if agent == "vertical" else horizontal

    return rule


def policies(env_cls: type) -> dict[str, ReferencePolicy]:
    """The env's reference policies and the four coordinate rules."""
    rules = {f"coordinates_{v}_{h}": coordinate_rule(v, h) for v in "UD" for h in "LR"}
    return {**env_cls.reference_policies(), **rules}


async def success_rates(
    config: Config, count: int | None = None, names: list[str] | None = None
) -> dict[str, dict[str, Any]]:
    """name -> {"team_success_rate", "exact"} of every policy (or those `names`) on the run's held-out
    problems (the first `count`, default `eval.size`), each problem played as one baseline episode of the run."""
    env_cls = resolve(config.env.name, ENVS, "env")
    _, test = run_problems(env_cls, config.env.train_size, config.env.test_size, config.env.options)
    problems = test[: count or config.eval.size]
    config.eval.size, config.eval.baseline_draws, config.eval.k = len(problems), 1, 1
    nodes = {agent: resolve(spec.node, NODES, "node")(agent) for agent, spec in config.agents.items()}
    workflow = resolve(config.workflow.name, WORKFLOWS, "workflow")(nodes, **config.workflow.options)

    def player(name: str, policy: ReferencePolicy, problem: dict) -> PlayOnce:
        async def play(rng: random.Random) -> dict:
            env = env_cls()
            env.reset(seed=problem.get("seed"), options={"problem": problem})
            episode = BaselineEpisode(
                name=name, policies={name: policy}, rng=rng, episode_id=f"{name}-{problem.get('seed')}",
                problem_id=str(problem.get("seed")), env=env, policy_of=config.policy_of(),
                alpha=config.algorithm.alpha,
            )  # fmt: skip
            await workflow.run(episode)
            return episode.finish()

        return play

    figures = {}
    for name, policy in policies(env_cls).items():
        if names is not None and name not in names:
            continue
        played = ExpectedBaselines(draws_per_episode(config), exact_paths(config, env_cls))
        total = 0.0
        for index, problem in enumerate(problems):
            total += (await played.summary(name, problem, index, player(name, policy, problem)))["success"]
        figures[name] = {"team_success_rate": total / len(problems), "exact": played.drawn == 0}
        if played.drawn:
            figures[name]["draws_per_problem"] = played.draws
            figures[name]["standard_error_at_most"] = math.sqrt(0.25 / (played.draws * len(problems)))
    return figures


def trained(folder: Path) -> dict[str, Any]:
    """The last evaluation's held-out success of a results folder."""
    rows = [json.loads(line) for line in (folder / "eval.jsonl").read_text().splitlines() if line.strip()]
    return {"iteration": rows[-1]["iteration"], "team_success_rate": rows[-1]["eval/team_success_rate"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--run", default=RUN, help=f"a results folder or run directory with config.yaml (default {RUN})"
    )
    parser.add_argument("--trained", nargs="*", default=SEEDS, help="results folders whose last evaluation to show")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--smoke", action="store_true", help="8 problems only")
    args = parser.parse_args()
    config = load_config(ROOT / args.run / "config.yaml")  # (an absolute --run replaces ROOT)
    figures = asyncio.run(success_rates(config, 8 if args.smoke else None))
    seeds = {folder: trained(ROOT / folder) for folder in args.trained}
    print(f"held-out team success on {args.run}'s {8 if args.smoke else config.eval.size} held-out problems")
    for name, figure in figures.items():
        how = "exact" if figure["exact"] else f"{figure['draws_per_problem']} draws a problem"
        print(f"  {name:<18} {figure['team_success_rate']:.3f}  ({how})")
    for folder, figure in seeds.items():
        print(f"  trained {folder}, iteration {figure['iteration']}: {figure['team_success_rate']:.3f}")
    if args.json:
        out = {
            "run": args.run,
            "problems": 8 if args.smoke else config.eval.size,
            "policies": figures,
            "trained": seeds,
        }
        Path(args.json).write_text(json.dumps(without_machine_paths(out), indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
