"""The single-agent Plan-Path baseline: one agent makes every move, in any direction."""

from __future__ import annotations

import pytest

from envs.plan_path_solo import PlanPathSoloEnv
from mas_async.api import ParseError
from nodes.plan_path import SoloMover

OPEN = {"seed": 0, "rows": 3, "cols": 3, "walls": [], "start": [0, 0], "goal": [2, 2], "shortest": 4}


def _env(problem=OPEN) -> PlanPathSoloEnv:
    env = PlanPathSoloEnv()
    env.reset(options={"problem": problem})
    return env


def test_moves_on_both_axes_and_rewards_progress():
    env, node = _env(), SoloMover()
    after = env.clone()
    after.step("solo", "D")
    assert after.position == (1, 0) and env.position == (0, 0)  # the clone moved, the original did not
    assert node.local_reward(env, "D", after) == 1.0
    for move in ("R", "D", "R"):
        after.step("solo", move)
    assert after.team_reward() == 1.0 and after.done and after.terminations == {"solo": True}


def test_a_blocked_move_is_penalised():
    env, node = _env(), SoloMover()
    after = env.clone()
    after.step("solo", "U")  # off the grid
    assert after.position == (0, 0) and after.infos == {"solo": {"blocked": True}}
    assert node.local_reward(env, "U", after) == node.invalid_penalty


def test_parse_and_observation():
    node = SoloMover()
    assert [node.parse(t) for t in (" U\n", "D", "L", "RR")] == ["U", "D", "L", "R"]
    for bad in ("S", "", "X", "1"):
        with pytest.raises(ParseError):
            node.parse(bad)
    assert _env().observe("solo").splitlines()[0] == "S"
    with pytest.raises(ValueError, match="only agent"):
        _env().observe("vertical")
    with pytest.raises(ValueError, match="U, D, L, R"):
        _env().step("solo", "S")
