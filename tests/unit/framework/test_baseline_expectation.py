"""A baseline's figure is its expectation on each problem: exact where the policy's random choices can be
enumerated (the same as playing every sequence of moves by hand), else enough seeded draws for a standard
error of at most 0.005 over the held-out problems; the env worker reports that expectation."""

from __future__ import annotations

import asyncio
import itertools
import math
import random

import pytest

from envs.plan_path import PlanPathEnv
from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.rollout.baseline import (
    EXACT_PATHS,
    BaselineEpisode,
    ExpectedBaselines,
    ScriptedRandom,
    draws_per_episode,
    enumerate_choices,
    exact_paths,
)
from mas_async.rollout.env_worker import EnvWorker
from mas_async.wire.messages import EpisodeDone, RunEpisode
from nodes.plan_path import HorizontalMover, PlanPathWorkflow, VerticalMover
from tests.support.paths import ROOT

# A 3x3 grid, a wall right of the middle; the goal two rows down and two columns right of the start: reached
# in 4 moves (D, R, D, R) or 6, or not in 3 turns.
PROBLEM = {"seed": -1, "rows": 3, "cols": 3, "walls": [[1, 2]], "start": [0, 0], "goal": [2, 2]}
TURNS = 3


def _player(policies: dict, name: str, plays: list[int] | None = None):
    workflow = PlanPathWorkflow({"vertical": VerticalMover(), "horizontal": HorizontalMover()}, max_turns=TURNS)

    async def play(rng: random.Random) -> dict:
        if plays is not None:
            plays.append(1)
        env = PlanPathEnv()
        env.reset(options={"problem": PROBLEM})
        episode = BaselineEpisode(
            name=name, policies=policies, rng=rng, episode_id="b", problem_id="t", env=env,
            policy_of={"vertical": "v", "horizontal": "h"}, alpha=1.0,
        )  # fmt: skip
        await workflow.run(episode)
        return episode.finish()

    return play


def _by_hand() -> dict[str, float]:
    """Every sequence of 2 x TURNS moves played as a constant script, each with probability 1 / 2^(2 TURNS):
    success and rewards averaged over them (moves after the goal are never played)."""
    totals = {"success": 0.0, "reward/vertical": 0.0, "reward/horizontal": 0.0}
    sequences = list(itertools.product(*[("U", "D"), ("L", "R")] * TURNS))
    for moves in sequences:
        queue = list(moves)
        policy = {"script": lambda env, agent, rng, queue=queue: queue.pop(0)}
        summary = asyncio.run(_player(policy, "script")(random.Random(0)))
        for key in totals:
            totals[key] += float(summary[key]) / len(sequences)
    return totals


def test_the_exact_figure_is_every_sequence_of_moves_played_by_hand() -> None:
    expected = asyncio.run(enumerate_choices(_player(PlanPathEnv.reference_policies(), "random")))
    assert expected is not None
    for key, value in _by_hand().items():
        assert expected[key] == pytest.approx(value, abs=1e-12), key
    assert 0 < expected["success"] < 1  # a probability, not one draw's 0 or 1


def test_a_worker_enumerates_a_problem_once_and_a_policy_without_choices_once() -> None:
    plays: list[int] = []
    baselines = ExpectedBaselines(draws=500)
    play = _player(PlanPathEnv.reference_policies(), "random", plays)
    first = asyncio.run(baselines.summary("random", PROBLEM, 0, play))
    enumerated = len(plays)
    again = asyncio.run(baselines.summary("random", {**PROBLEM, "seed": 7}, 1, play))  # same content
    assert again == first and len(plays) == enumerated and baselines.drawn == 0
    plays.clear()
    constant = _player(PlanPathEnv.reference_policies(), "always_D_R", plays)
    assert asyncio.run(baselines.summary("always_D_R", PROBLEM, 0, constant))["success"] in (0.0, 1.0)
    assert len(plays) == 1  # it made no choice: that sequence is the only one


def test_a_policy_that_cannot_be_enumerated_is_drawn_as_often_as_asked() -> None:
    def uniform(env, agent: str, rng: random.Random) -> str:  # rng.random(): no list of choices
        moves = ("U", "D") if agent == "vertical" else ("L", "R")
        return moves[int(rng.random() * 2)]

    plays: list[int] = []
    baselines = ExpectedBaselines(draws=1000)
    drawn = asyncio.run(baselines.summary("uniform", PROBLEM, 0, _player({"uniform": uniform}, "uniform", plays)))
    assert baselines.drawn == 1 and len(plays) == 1000 + 1  # the probe that found rng.random(), then the draws
    exact = _by_hand()["success"]
    assert drawn["success"] == pytest.approx(exact, abs=4 * math.sqrt(exact * (1 - exact) / 1000))
    with pytest.raises(Exception, match="rng.random"):
        ScriptedRandom([]).random()


def test_too_many_sequences_are_drawn() -> None:
    plays: list[int] = []
    baselines = ExpectedBaselines(draws=50, max_paths=4)  # 2^6 sequences of random moves here
    asyncio.run(baselines.summary("random", PROBLEM, 0, _player(PlanPathEnv.reference_policies(), "random", plays)))
    assert baselines.drawn == 1 and len(plays) == 1 + 8 + 50  # the first sequence, the probes, then the draws
    asyncio.run(baselines.summary("random", PROBLEM, 1, _player(PlanPathEnv.reference_policies(), "random", plays)))
    assert len(plays) == 1 + 8 + 50 + 50  # known to be too many: no probe again


@pytest.mark.parametrize(
    "overrides",
    [[], ["eval.baseline_draws=1"], ["eval.size=64", "env.test_size=64"], ["eval.size=3", "env.test_size=2"],
     ["eval.k=4", "eval.greedy=false", "eval.baseline_draws=7"], ["eval.baseline_standard_error=0.05"]],
)  # fmt: skip
def test_the_draws_give_a_standard_error_of_at_most_0_005(overrides: list[str]) -> None:
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", overrides)
    target = config.eval.baseline_standard_error
    assert target == (0.05 if overrides[-1:] == ["eval.baseline_standard_error=0.05"] else 0.005)  # the default
    draws = draws_per_episode(config)
    problems = min(config.eval.size, config.env.test_size)
    episodes = config.eval.baseline_draws * config.eval.k  # per problem, each playing `draws`

    def worst(draws: int) -> float:  # p(1 - p) <= 0.25 on every problem
        return math.sqrt(0.25 / (draws * episodes) / problems)

    assert worst(draws) <= target and (draws == 1 or worst(draws - 1) > target)  # enough, and no more


def test_the_env_worker_reports_the_expectation(tiny_model) -> None:
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", [f"workflow.options.max_turns={TURNS}"])
    paths = {"vertical": str(tiny_model), "horizontal": str(tiny_model)}
    worker = EnvWorker(config, Deployment("tcp://127.0.0.1:1", {}, paths), 0)
    sent: list = []
    worker.send = sent.append
    for copy in range(2):
        run = RunEpisode(f"baseline-random-0-0-{copy}", 0, "baseline/random", 0, "test0", PROBLEM, copy, 0)
        asyncio.run(worker._run_episode(run))
    done = [m for m in sent if isinstance(m, EpisodeDone)]
    assert [d.error for d in done] == ["", ""] and done[0].summary == done[1].summary
    assert done[0].summary["success"] == pytest.approx(_by_hand()["success"], abs=1e-12)


def test_an_env_that_runs_programs_enumerates_no_more_than_it_would_draw() -> None:
    from envs.tool_plan import PlanPathToolPlanEnv

    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["eval.baseline_standard_error=0.02"])
    assert exact_paths(config, PlanPathEnv) == EXACT_PATHS
    per_problem = draws_per_episode(config) * config.eval.baseline_draws
    assert exact_paths(config, PlanPathToolPlanEnv) == per_problem < EXACT_PATHS
