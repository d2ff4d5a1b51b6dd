"""Sokoban env, its pushers and workflow: push rules, generation, rewards, observations and clones."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from envs.sokoban import Board, SokobanEnv, move, team_moves
from mas_async.api import ParseError
from mas_async.rollout.episode import Episode
from mas_async.wire.samples import Completion
from nodes.sokoban import ChatVerticalPusher, HorizontalPusher, SokobanWorkflow, VerticalPusher

ALLOWED = set("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ \n.#:,=-")


def level(rows: int, cols: int, targets: list, boxes: list, player: list) -> dict:
    """A walled room with no inner walls."""
    walls = [[r, c] for r in range(rows) for c in range(cols) if r in (0, rows - 1) or c in (0, cols - 1)]
    return {
        "seed": -1,
        "rows": rows,
        "cols": cols,
        "walls": walls,
        "targets": targets,
        "boxes": boxes,
        "player": player,
    }


# ######
# #A.BT#     one push right solves it, but the vertical mover moves first and every other move: it can
# #....#     only bump into the top wall (or step down and back up), so the team needs 4 moves:
# ######     U (blocked), R, U (blocked), R (the push).
CORRIDOR = level(4, 6, targets=[[1, 4]], boxes=[[1, 3]], player=[1, 1])
# #####
# #...#
# #.B.#      pushing the box up puts it against the top wall, and its target is in the bottom row:
# #.AT#      a deadlock.
# #####
CORNER = level(5, 5, targets=[[3, 3]], boxes=[[2, 2]], player=[3, 2])


class FakeTokenizer:
    """Characters are token ids; 0 is the only special token (end of text)."""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool, tokenize: bool) -> list[int]:
        return [ord(ch) for m in messages for ch in m["content"]] + [1]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if i != 0)


def scripted(replies: list[list[str]]):
    """A `generate` that answers each call with the next list of texts (one per candidate)."""

    async def generate(policy: str, prompt_ids: np.ndarray, n: int, greedy: bool) -> list[Completion]:
        texts = replies.pop(0)
        assert len(texts) == n
        return [
            Completion(np.array([ord(ch) for ch in t] + [0], np.int32), np.zeros(len(t) + 1, np.float32), 0)
            for t in texts
        ]

    return generate


def episode(env, agents: tuple[str, ...], replies: list[list[str]], k: int) -> Episode:
    return Episode(
        episode_id="e",
        problem_id="p",
        env=env,
        policy_of={a: "shared" for a in agents},
        tokenizers={"shared": FakeTokenizer()},
        generate=scripted(replies),
        k=k,
        alpha=1.0,
    )


def make_env(problem: dict) -> SokobanEnv:
    env = SokobanEnv()
    env.reset(options={"problem": problem})
    return env


def test_push_rules() -> None:
    board = Board(4, 6, frozenset(), frozenset({(1, 4)}))
    assert move(board, ((1, 2), ((1, 3),)), (0, 1)) == (((1, 3), ((1, 4),)), False)  # pushes the box
    assert move(board, ((1, 3), ((1, 4),)), (0, 1)) == (((1, 4), ((1, 5),)), False)
    assert move(board, ((1, 4), ((1, 5),)), (0, 1)) == (((1, 4), ((1, 5),)), True)  # box against the edge
    assert move(board, ((1, 1), ((1, 2), (1, 3))), (0, 1)) == (((1, 1), ((1, 2), (1, 3))), True)  # two boxes
    walled = Board(4, 6, frozenset({(1, 2)}), frozenset())
    assert move(walled, ((1, 1), ()), (0, 1)) == (((1, 1), ()), True)
    assert move(walled, ((1, 1), ()), (1, 0)) == (((2, 1), ()), False)


def test_team_moves_hand_computed() -> None:
    env = make_env(CORRIDOR)
    assert team_moves(env.board, env.state) == 4
    assert env.distance("vertical") == 4
    assert env.distance("horizontal") == 3  # R, U (blocked), R
    env = make_env(level(4, 6, targets=[[1, 4]], boxes=[[1, 3]], player=[2, 2]))
    assert team_moves(env.board, env.state) == 2  # U, then the push R


def test_observation_format_and_characters() -> None:
    env = make_env(CORRIDOR)
    assert env.observe("vertical") == "V\n######\n#A.BT#\n#....#\n######\nA=1,1 B=1,3 T=1,4"
    env.step("vertical", "U")
    env.step("horizontal", "R")
    env.step("vertical", "U")
    env.step("horizontal", "R")
    assert env.observe("horizontal") == "H\n######\n#..AX#\n#....#\n######\nA=1,3 B=1,4 T=1,4"
    for problem in SokobanEnv.problems("train", 20, sizes=[7], boxes=[1, 2]):
        assert set(make_env(problem).observe("vertical")) <= ALLOWED


def test_solving_terminates_with_team_reward_one() -> None:
    env = make_env(CORRIDOR)
    for agent, action in (("vertical", "U"), ("horizontal", "R"), ("vertical", "U")):
        env.step(agent, action)
        assert env.team_reward() == 0.0 and not env.done
    assert env.infos["vertical"]["blocked"]
    env.step("horizontal", "R")
    assert env.team_reward() == 1.0 and env.success() and all(env.terminations.values())
    assert not any(env.truncations.values())
    with pytest.raises(ValueError, match="over"):
        env.step("vertical", "D")


def test_team_reward_counts_boxes_on_targets() -> None:
    # #######
    # #...X.#    one box already on its target, the other one push short of it
    # #A.B..#    (targets at (1, 4) and (2, 4))
    # #######
    env = make_env(level(4, 7, targets=[[1, 4], [2, 4]], boxes=[[1, 4], [2, 3]], player=[2, 1]))
    assert env.team_reward() == 0.5
    env.step("vertical", "D")  # bumps into the bottom wall
    env.step("horizontal", "R")  # walks to (2, 2)
    env.step("vertical", "D")
    assert env.state[0] == (2, 2) and env.team_reward() == 0.5 and not env.done
    env.step("horizontal", "R")  # pushes the second box onto its target
    assert env.team_reward() == 1.0 and env.done


def test_deadlock_terminates_and_gets_the_penalty() -> None:
    before = make_env(CORNER)
    assert before.distance("vertical") == 7
    after = before.clone()
    after.step("vertical", "U")  # box to (1, 2), against the top wall
    assert after.infos["vertical"] == {"blocked": False, "deadlock": True} and after.done
    assert after.team_reward() == 0.0 and not after.success()
    assert VerticalPusher().local_reward(before, "U", after) == -1.0


def test_local_rewards_hand_computed() -> None:
    vertical, horizontal = VerticalPusher(), HorizontalPusher()
    start = make_env(CORRIDOR)  # 4 team moves with the vertical pusher next, 3 with the horizontal one
    for action in ("U", "D"):  # a bump into the top wall and a step down are both on a shortest plan
        after = start.clone()
        after.step("vertical", action)
        assert vertical.local_reward(start, action, after) == 1.0
    waited = start.clone()
    waited.step("vertical", "U")
    cases = [("R", 1.0), ("L", -1.0)]  # R: 3 -> 2 moves left; L: bumps the wall, 3 -> 4
    for action, expected in cases:
        after = waited.clone()
        after.step("horizontal", action)
        assert horizontal.local_reward(waited, action, after) == expected, action


def test_parse_and_unparsable_answers_get_the_penalty() -> None:
    node = VerticalPusher()
    assert node.parse(" D\n") == "D" and node.parse("UL") == "U"
    for text in ("", "L", "X", " "):
        with pytest.raises(ParseError):
            node.parse(text)
    assert ChatVerticalPusher().parse("<think>U?</think>I move D.") == "D"
    with pytest.raises(ParseError):
        ChatVerticalPusher().parse("DOWN")
    # In an episode, every candidate is kept: the unparsable ones with the node's penalty.
    ep = episode(make_env(CORRIDOR), ("vertical",), [["U", "X", "", "D"]], k=4)
    chosen = asyncio.run(ep.act(node))
    assert [s.reward for s in ep.samples] == [1.0, -1.0, -1.0, 1.0]
    assert [s.valid for s in ep.samples] == [True, False, False, True]
    assert chosen.action in ("U", "D")


def test_workflow_solves_the_corridor() -> None:
    nodes = {"vertical": VerticalPusher(), "horizontal": HorizontalPusher()}
    replies = [["U", "D"], ["R", "L"], ["U", "U"], ["R", "R"]]
    ep = episode(make_env(CORRIDOR), ("vertical", "horizontal"), replies, k=2)
    asyncio.run(SokobanWorkflow(nodes, max_turns=5).run(ep))
    assert ep.env.success() and not replies
    assert [s.group for s in ep.samples[::2]] == ["e/vertical/0", "e/horizontal/0", "e/vertical/1", "e/horizontal/1"]
    assert ep.finish()["success"] is True


def test_clone_is_independent() -> None:
    env = make_env(CORRIDOR)
    copy = env.clone()
    copy.step("vertical", "D")
    assert env.state == ((1, 1), ((1, 3),)) and copy.state == ((2, 1), ((1, 3),))
    assert not env.infos["vertical"]["blocked"]
    env.step("vertical", "U")
    assert env.infos["vertical"]["blocked"] and not copy.infos["vertical"]["blocked"]


@pytest.mark.parametrize("split", ["train", "test"])
def test_generated_levels_are_valid_and_team_solvable(split: str) -> None:
    problems = SokobanEnv.problems(split, 60, boxes=[1, 2], max_moves=14)
    for problem in problems:
        assert json.loads(json.dumps(problem)) == problem
        assert 5 <= problem["rows"] <= 7 and 5 <= problem["cols"] <= 7
        env = make_env(problem)
        border = {(r, c) for r in range(env.board.rows) for c in range(env.board.cols)} - {
            (r, c) for r in range(1, env.board.rows - 1) for c in range(1, env.board.cols - 1)
        }
        assert border <= env.board.walls
        assert len(problem["boxes"]) == len(problem["targets"]) in (1, 2)
        assert not env.done and env.team_reward() < 1.0
        assert team_moves(env.board, env.state) == problem["team_moves"] == env.distance("vertical")
        assert 2 <= problem["team_moves"] <= 14


def test_problems_are_deterministic_and_splits_disjoint() -> None:
    assert SokobanEnv.problems("train", 5) == SokobanEnv.problems("train", 5)
    assert SokobanEnv.problems("train", 3, first=2) == SokobanEnv.problems("train", 5)[2:]
    train = {p["seed"] for p in SokobanEnv.problems("train", 30)}
    test = {p["seed"] for p in SokobanEnv.problems("test", 30)}
    assert train == set(range(30)) and not train & test


def test_problem_options_and_mistakes() -> None:
    for problem in SokobanEnv.problems("train", 5, sizes=[6], boxes=2, density=0.0):
        assert (problem["rows"], problem["cols"]) == (6, 6) and len(problem["boxes"]) == 2
    with pytest.raises(ValueError, match="split"):
        SokobanEnv.problems("dev", 1)
    with pytest.raises(ValueError, match="sizes"):
        SokobanEnv.problems("train", 1, sizes=[3])
    with pytest.raises(ValueError, match="boxes"):
        SokobanEnv.problems("train", 1, boxes=[0])
    with pytest.raises(ValueError, match="density"):
        SokobanEnv.problems("train", 1, density=0.7)
    with pytest.raises(ValueError, match="max_moves"):
        SokobanEnv.problems("train", 1, max_moves=1)
    with pytest.raises(ValueError, match="on a wall"):
        make_env({**CORRIDOR, "player": [0, 0]})
    with pytest.raises(ValueError, match="lacks"):
        make_env({"rows": 4})
    env = make_env(CORRIDOR)
    with pytest.raises(ValueError, match="cannot play"):
        env.step("vertical", "L")
    with pytest.raises(ValueError, match="unknown agent"):
        env.observe("diagonal")


def test_prompts_fit_the_tiny_model() -> None:
    from mas_async.rollout.chat_prompt import chat_prompt_ids
    from mas_async.tiny_model import PRESETS, UNK_TOKEN, VOCAB, build_tokenizer

    tokenizer = build_tokenizer()
    longest = 0
    for problem in SokobanEnv.problems("train", 20, sizes=[7], boxes=[3]):
        ids = chat_prompt_ids(tokenizer, VerticalPusher().prompt(make_env(problem).observe("vertical")))
        assert VOCAB.index(UNK_TOKEN) not in ids.tolist()
        longest = max(longest, len(ids))
    assert longest < PRESETS["tiny-char"].max_position_embeddings // 3
