"""The PettingZoo adapter: PettingZoo's own api_test on every registered env and on run configs, and the
adapter's turns, rewards, invalid actions and truncation on hand-built cases."""

from __future__ import annotations

import warnings

import pytest
from pettingzoo.test import api_test

from envs import ENVS
from envs.pettingzoo_adapter import PettingZooEnv, TextObservation, aec_env, from_config
from envs.sokoban import SokobanEnv
from nodes.sokoban import HorizontalPusher, VerticalPusher
from tests.support.paths import ROOT
from tests.unit.envs.test_sokoban import CORRIDOR


@pytest.fixture(autouse=True)
def quiet_api_test():
    # api_test warns about everything that is not a numpy Box (text spaces, agent names, no render).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("key", sorted(ENVS))
def test_api_test_passes_on_every_registered_env(key: str) -> None:
    env = aec_env(key)
    api_test(env, num_cycles=1000)
    env.close()


@pytest.mark.parametrize(
    "config",
    [
        "configs/sokoban_tiny.yaml",
        "configs/sudoku_tiny.yaml",
        "configs/plan_path_10x10_tiny.yaml",
        "configs/examples/custom_node.yaml",
    ],
)
def test_api_test_passes_with_a_configs_team(config: str) -> None:
    env = from_config(str(ROOT / config))
    assert env.nodes and env.max_cycles >= 8
    api_test(env, num_cycles=1000)


def corridor(**kwargs) -> PettingZooEnv:
    nodes = {"vertical": VerticalPusher(), "horizontal": HorizontalPusher()}
    env = PettingZooEnv(SokobanEnv, nodes=nodes, problems=[CORRIDOR], **kwargs)
    env.reset(seed=0)
    return env


def test_rewards_turns_and_invalid_actions_on_a_hand_level() -> None:
    env = corridor()
    assert env.agent_selection == "vertical"
    env.step("X")  # unparsable: the turn is spent, the state is unchanged, the penalty is paid
    assert env.rewards == {"vertical": -1.0, "horizontal": 0.0}
    assert env.infos["vertical"]["error"].startswith("ParseError: vertical: expected one of U, D")
    assert env.agent_selection == "horizontal" and env.env.state == ((1, 1), ((1, 3),))
    env.step("R")  # 3 -> 2 team moves left
    assert env.rewards == {"vertical": 0.0, "horizontal": 1.0} and env.infos["horizontal"]["error"] is None
    env.step("U")  # a bump into the wall, which is the team's shortest plan: 2 -> 1
    assert env.rewards == {"vertical": 1.0, "horizontal": 0.0}
    env.step("R")  # the push: solved; both get the team reward, the pusher also its progress
    assert env.rewards == {"vertical": 1.0, "horizontal": 2.0}
    assert env.terminations == {"vertical": True, "horizontal": True}
    seen = []
    for agent in env.agent_iter():
        obs, reward, terminated, truncated, info = env.last()
        seen.append((agent, reward, terminated))
        env.step(None)
    assert seen == [("vertical", 2.0, True), ("horizontal", 2.0, True)] and env.agents == []


def test_turn_order_comes_from_the_workflow_or_is_given() -> None:
    env = aec_env("sudoku", workflow="sudoku")
    env.reset(seed=0)
    assert env.order == ["chooser", "placer"] and env.agent_selection == "chooser"
    env = corridor(order=["horizontal", "vertical"])
    assert env.agent_selection == "horizontal"
    env.step("R")
    assert env.agent_selection == "vertical"
    with pytest.raises(ValueError, match="must name distinct agents"):
        PettingZooEnv(SokobanEnv, order=["vertical", "diagonal"])


def test_everyone_is_truncated_after_max_cycles() -> None:
    env = corridor(max_cycles=2)
    for action in ("D", "L", "U"):
        env.step(action)
        assert not any(env.truncations.values())
    env.step("L")
    assert env.truncations == {"vertical": True, "horizontal": True} and not any(env.terminations.values())


def test_observations_are_text_in_their_space() -> None:
    env = corridor()
    obs = env.observe("vertical")
    assert isinstance(obs, TextObservation) and isinstance(obs, str) and obs == SokobanEnv.observe(env.env, "vertical")
    assert env.observation_space("vertical").contains(obs) and obs.dtype == env.observation_space("vertical").dtype
    assert env.observation_space("vertical") is env.observation_space("vertical")


def test_reset_picks_problems_by_seed_or_option() -> None:
    first, second = aec_env("sokoban"), aec_env("sokoban")
    first.reset(seed=3)
    second.reset(seed=3)
    assert first.observe("vertical") == second.observe("vertical")
    second.reset(seed=2)
    assert first.observe("vertical") != second.observe("vertical")
    second.reset(options={"problem": CORRIDOR})
    assert second.observe("vertical").startswith("V\n######\n#A.BT#")
    with pytest.raises(RuntimeError, match="call reset"):
        aec_env("sokoban").observe("vertical")
