"""check_env over every registered env, and on deliberately broken envs (each must be caught by name)."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from envs import ENVS
from envs.check import EnvCheckError, check_env, held_out_states
from envs.sokoban import SokobanEnv
from envs.sudoku import SudokuEnv
from mas_async.api import resolve


@pytest.mark.parametrize("key", sorted(ENVS))
def test_every_registered_env_passes(key: str) -> None:
    env_cls = resolve(key, ENVS, "env")
    report = check_env(env_cls)
    assert {"api", "problem determinism", "split disjointness", "clone independence"} <= set(report.checked)
    assert {"documentation", "infos documented"} <= set(report.checked), report  # actions, rewards, infos said
    assert callable(getattr(env_cls, "action_examples", None)), f"{key} has no action_examples"
    assert "stepping" in report.checked and not report.skipped, report


def test_options_reach_the_problems() -> None:
    report = check_env(SudokuEnv, sizes=[9], holes=20)
    assert "stepping" in report.checked
    with pytest.raises(TypeError):
        check_env(SudokuEnv, no_such_option=1)


class SharedDicts(SokobanEnv):
    def clone(self) -> SokobanEnv:
        return copy.copy(self)  # shares terminations, truncations and infos


class SharedGrid(SudokuEnv):
    def clone(self) -> SudokuEnv:
        other = copy.copy(self)
        other.terminations, other.truncations = dict(self.terminations), dict(self.truncations)
        other.infos = copy.deepcopy(self.infos)
        return other  # ... but the grid is shared


class RandomProblems(SokobanEnv):
    @classmethod
    def problems(cls, split: str, count: int, **options: Any) -> list[dict[str, Any]]:
        return SokobanEnv.problems(split, count, first=random.randrange(1000), **options)


class OverlappingSplits(SokobanEnv):
    @classmethod
    def problems(cls, split: str, count: int, **options: Any) -> list[dict[str, Any]]:
        return SokobanEnv.problems("train", count, **options) if split in ("train", "test") else []


class TupleProblems(SokobanEnv):
    @classmethod
    def problems(cls, split: str, count: int, **options: Any) -> list[dict[str, Any]]:
        return [{**p, "player": tuple(p["player"])} for p in SokobanEnv.problems(split, count, **options)]


class AccentedObservation(SokobanEnv):
    def observe(self, agent: str) -> str:
        return super().observe(agent) + "é"


class ListObservation(SokobanEnv):
    def observe(self, agent: str) -> Any:
        return super().observe(agent).split("\n")


class RewardOutOfRange(SokobanEnv):
    def team_reward(self) -> float:
        return super().team_reward() - 0.5


class RandomSteps(SudokuEnv):
    def step(self, agent: str, action: str) -> None:
        super().step(agent, random.choice(self.action_examples(agent) or [action]))


class IntTerminations(SokobanEnv):
    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        super().reset(seed=seed, options=options)
        self.terminations = {agent: 0 for agent in self.possible_agents}


class MissingAgent(SokobanEnv):
    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        super().reset(seed=seed, options=options)
        del self.infos["horizontal"]


class NoAgents(SokobanEnv):
    possible_agents: list[str] = []


class LenientSplits(SokobanEnv):
    @classmethod
    def problems(cls, split: str, count: int, **options: Any) -> list[dict[str, Any]]:
        return SokobanEnv.problems("train" if split == "train" else "test", count, **options)


@pytest.mark.parametrize(
    "broken, prop, detail",
    [
        (SharedDicts, "clone independence", "shares the terminations dict"),
        (SharedGrid, "clone independence", "changed the original"),
        (RandomProblems, "problem determinism", "differ"),
        (OverlappingSplits, "split disjointness", "both the train and the test split"),
        (TupleProblems, "problems", "JSON round trip"),
        (AccentedObservation, "observe", "outside the env's observation_charset"),
        (ListObservation, "observe", "is a list, not a str"),
        (RewardOutOfRange, "team_reward", "must lie in [0, 1]"),
        (RandomSteps, "determinism", "different states"),
        (IntTerminations, "api", "terminations['vertical'] must be a bool"),
        (MissingAgent, "api", "infos must be a dict keyed by"),
        (NoAgents, "possible_agents", "non-empty list"),
        (LenientSplits, "split disjointness", "no-such-split"),
    ],
)
def test_a_broken_env_is_caught_by_name(broken: type, prop: str, detail: str) -> None:
    with pytest.raises(EnvCheckError) as caught:
        check_env(broken, steps=12)
    message = str(caught.value)
    assert message.startswith(f"check_env(tests.unit.envs.test_check_env:{broken.__name__}): {prop}: "), message
    assert detail in message, message


def test_plan_path_grids_up_to_10x10() -> None:
    from envs.plan_path import PlanPathEnv
    from mas_async.rollout.chat_prompt import chat_prompt_ids
    from mas_async.tiny_model import CHARACTERS, PRESETS, build_tokenizer

    check_env(PlanPathEnv, sizes=[10])
    tokenizer = build_tokenizer()
    for problem in PlanPathEnv.problems("train", 20, sizes=[8, 10]):
        env = PlanPathEnv()
        env.reset(options={"problem": problem})
        obs = env.observe("vertical")
        assert set(obs) <= set(CHARACTERS)
        assert (
            len(chat_prompt_ids(tokenizer, [{"role": "user", "content": obs}]))
            < PRESETS["tiny-char"].max_position_embeddings // 3
        )


class UnsaidInfo(SudokuEnv):
    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        super().reset(seed, options)
        self.infos["placer"]["hint"] = 3  # a key info_keys does not document


class UnsaidAction(SudokuEnv):
    actions = {"chooser": "a letter"}  # the placer's action is not said


def test_an_undocumented_info_key_or_action_is_caught_by_name() -> None:
    with pytest.raises(EnvCheckError, match=r"documentation: after reset, infos\['placer'\] holds \['hint'\]"):
        check_env(UnsaidInfo)
    with pytest.raises(EnvCheckError, match=r"documentation: actions .* none for \['placer'\]"):
        check_env(UnsaidAction)


# -- held-out states that training problems reach ------------------------------------------------------


def _problem(seed: int, start: list, goal: list) -> dict[str, Any]:
    return {"seed": seed, "rows": 3, "cols": 3, "walls": [], "start": start, "goal": goal}


def test_held_out_states_that_training_reaches_are_counted() -> None:
    from envs.plan_path import PlanPathEnv

    train = [_problem(0, [0, 0], [2, 2])]
    # The same grid and goal from another start: every state of it is one training reaches. Another goal:
    # none is (G is elsewhere in every observation).
    same_goal, other_goal = _problem(1, [0, 1], [2, 2]), _problem(2, [0, 1], [2, 0])
    found = held_out_states(PlanPathEnv, train, [same_goal, other_goal], depth=8)
    assert (found.states, found.seen, found.starts, found.starts_seen) == (18, 9, 2, 1)
    assert found.share == 0.5 and not found.bounded
    assert "9 of 18 (50%), start states 1 of 2" in str(found)
    # One action deep: training reaches A at 0,0, 1,0 and 0,1 (the held-out start); the held-out start
    # reaches 0,1, 1,1, 0,0 and 0,2, two of them (0,1 and 0,0) reached by training too.
    shallow = held_out_states(PlanPathEnv, train, [same_goal], depth=1)
    assert (shallow.states, shallow.seen, shallow.starts_seen) == (4, 2, 1)
    assert held_out_states(PlanPathEnv, train, [same_goal], depth=8, limit=3).bounded


def test_check_env_reports_them_and_an_env_that_runs_programs_by_its_starts() -> None:
    from envs.plan_path import PlanPathEnv
    from envs.tool_plan import PlanPathToolPlanEnv

    report = check_env(PlanPathEnv, count=4)
    assert report.held_out is not None and report.held_out.test == report.held_out.train == 4
    assert "held-out states" in report.checked and "held-out states reachable from training problems" in str(report)
    problems = PlanPathToolPlanEnv.problems("train", 2, sizes=[4])
    assert held_out_states(PlanPathToolPlanEnv, problems, problems).depth == 0  # a step would run the sandbox


def test_the_command_reports_a_runs_problems(capsys) -> None:
    from mas_async.launch.env_check import main
    from tests.support.paths import ROOT

    assert main([str(ROOT / "configs/plan_path_smollm2_grid.yaml"), "env.train_size=64"]) == 0
    out = capsys.readouterr().out
    assert "the run's problems: held-out states reachable from training problems" in out
    assert "(64 held-out and 64 training problems, 8 actions deep)" in out
    assert main(["--help"]) == 2
