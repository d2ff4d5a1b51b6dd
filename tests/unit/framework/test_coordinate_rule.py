"""The coordinate rule (bench/coordinate_rule.py): toward G on each mover's own axis from the two positions
alone, a fixed move once aligned, walls never read. Its figures on the SmolLM2 grid run's held-out problems,
committed in results/bench/, are what it plays now, and README.md and docs/results.md quote them."""

from __future__ import annotations

import asyncio
import json
import random

from bench.coordinate_rule import coordinate_rule, success_rates
from envs.plan_path import PlanPathEnv
from mas_async.config import load_config
from tests.support.paths import ROOT

FIGURES = ROOT / "results/bench/coordinate_rule-smollm2_grid.json"


def _grid(walls: list, start: list, goal: list) -> PlanPathEnv:
    env = PlanPathEnv()
    env.reset(options={"problem": {"seed": -1, "rows": 3, "cols": 3, "walls": walls, "start": start, "goal": goal}})
    return env


def test_the_rule_reads_the_coordinates_and_never_the_walls() -> None:
    rule, rng = coordinate_rule("D", "L"), random.Random(0)
    env = _grid([[1, 0]], [0, 0], [2, 2])  # a wall right below A: the rule steps into it all the same
    assert rule(env, "vertical", rng) == "D" and rule(env, "horizontal", rng) == "R"
    env = _grid([], [2, 2], [0, 0])
    assert rule(env, "vertical", rng) == "U" and rule(env, "horizontal", rng) == "L"
    env = _grid([[2, 1]], [1, 1], [1, 2])  # same row: the fixed move, down into the wall
    assert rule(env, "vertical", rng) == "D"
    assert coordinate_rule("U", "R")(_grid([], [1, 0], [2, 0]), "horizontal", rng) == "R"  # same column


def test_the_committed_figures_are_what_the_rule_and_random_play() -> None:
    committed = json.loads(FIGURES.read_text())
    config = load_config(ROOT / committed["run"] / "config.yaml")
    names = ["random", "coordinates_U_L", "coordinates_U_R", "coordinates_D_L", "coordinates_D_R"]
    now = asyncio.run(success_rates(config, names=names))
    assert committed["problems"] == 64
    for name in names:
        assert now[name] == committed["policies"][name], name
        assert now[name]["exact"]  # random's too: 4 turns are at most 2^8 sequences of moves a problem


def test_readme_and_results_quote_them() -> None:
    committed = json.loads(FIGURES.read_text())["policies"]
    rules = [committed[f"coordinates_{v}_{h}"]["team_success_rate"] for v in "UD" for h in "LR"]
    span = f"{min(rules):.2f}-{max(rules):.2f}"
    best = f"{committed['coordinates_D_L']['team_success_rate']:.3f}"
    for page in ("README.md", "docs/results.md"):
        text = (ROOT / page).read_text()
        assert "reads the coordinates" in text and "reads the grid" not in text, page
        assert span in text and best in text, (page, span, best)
