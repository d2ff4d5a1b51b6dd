"""The Episode context: tree sampling order, branch commitment, groups, tie-breaks and the summary.

A fake character-level tokenizer and a fake `generate` returning scripted completions record every
event, so the tests can assert the exact order in which candidates are sampled, scored and committed.
"""

from __future__ import annotations

import asyncio
import textwrap
from typing import Any

import numpy as np
import pytest

from envs.plan_path import PlanPathEnv
from mas_async.api import Env, Node, ParseError, Workflow, check_split
from mas_async.rollout.episode import Candidate, Episode
from mas_async.training.advantages import compute_advantages
from mas_async.wire.samples import Completion
from nodes.plan_path import HorizontalMover, PlanPathWorkflow, VerticalMover

# 3x3, no walls, start top-left, goal bottom-right (shortest 4, and 4 for the team: D, R, D, R).
OPEN = {
    "seed": -1,
    "rows": 3,
    "cols": 3,
    "walls": [],
    "start": [0, 0],
    "goal": [2, 2],
    "shortest": 4,
    "team_moves": 4,
}
EOS = 0


class FakeTokenizer:
    """Characters are token ids; EOS (0) is the only special token."""

    def __init__(self, batch_encoding: bool = False) -> None:
        self.batch_encoding = batch_encoding

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool, tokenize: bool) -> Any:
        assert add_generation_prompt and tokenize
        ids = [ord(ch) for m in messages for ch in f"<{m['role']}>{m['content']}"] + [ord(ch) for ch in "<a>"]
        return {"input_ids": [ids]} if self.batch_encoding else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == EOS))


class FakeGenerate:
    """Returns the scripted texts of each call in order and records ("generate", ...) events."""

    def __init__(self, scripts: list[list[str]], events: list[tuple], versions: list[int] | None = None) -> None:
        self.scripts = list(scripts)
        self.events = events
        self.versions = list(versions or [])
        """Weight version of each call's completions (default 3 for every call)."""

    async def __call__(self, policy: str, prompt_ids: np.ndarray, n: int, greedy: bool) -> list[Completion]:
        assert prompt_ids.dtype == np.int32 and prompt_ids.ndim == 1
        prompt = "".join(chr(i) for i in prompt_ids)
        self.events.append(("generate", policy, n, greedy, prompt))
        texts = self.scripts.pop(0)
        assert len(texts) == n
        version = self.versions.pop(0) if self.versions else 3
        return [
            Completion(
                token_ids=np.array([ord(ch) for ch in text] + [EOS], dtype=np.int32),
                logprobs=np.zeros(len(text) + 1, dtype=np.float32),
                version=version,
            )
            for text in texts
        ]


def recording(node: Node, events: list[tuple]) -> Node:
    """Wrap `node` so that parsing and scoring each candidate is recorded."""
    parse, local_reward = node.parse, node.local_reward

    def recorded_parse(text: str) -> Any:
        events.append(("parse", node.agent, text))
        return parse(text)

    def recorded_local_reward(before: Any, action: Any, after: Any) -> float:
        events.append(("score", node.agent, action))
        return local_reward(before, action, after)

    node.parse, node.local_reward = recorded_parse, recorded_local_reward
    return node


class RecordingEpisode(Episode):
    """An Episode that records when groups are recorded and branches committed, and keeps the groups."""

    def __init__(self, events: list[tuple], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.events = events
        self.groups: list[list[Candidate]] = []

    def record(self, node: Node, candidates: list[Candidate]) -> None:
        self.events.append(("record", node.agent, len(candidates)))
        self.groups.append(candidates)
        super().record(node, candidates)

    def commit(self, candidate: Candidate) -> None:
        self.events.append(("commit", candidate.agent, candidate.index))
        super().commit(candidate)


def make_episode(
    scripts: list[list[str]],
    events: list[tuple] | None = None,
    problem: dict | None = None,
    episode_id: str = "it0/p0/0",
    problem_id: str = "p0",
    k: int = 3,
    alpha: float = 1.0,
    mode: str = "train",
    seed: int = 0,
    tokenizer: FakeTokenizer | None = None,
) -> RecordingEpisode:
    events = [] if events is None else events
    env = PlanPathEnv()
    env.reset(options={"problem": problem or OPEN})
    return RecordingEpisode(
        events,
        episode_id=episode_id,
        problem_id=problem_id,
        env=env,
        policy_of={"vertical": "pv", "horizontal": "ph"},
        tokenizers={"pv": tokenizer or FakeTokenizer(), "ph": tokenizer or FakeTokenizer()},
        generate=FakeGenerate(scripts, events),
        k=k,
        alpha=alpha,
        mode=mode,
        seed=seed,
    )


def test_all_candidates_are_scored_before_the_branch_is_chosen() -> None:
    events: list[tuple] = []
    episode = make_episode([["U", "D", " U"]], events)
    asyncio.run(episode.act(recording(VerticalMover(), events)))
    prompt = "<user>V\nA..\n...\n..G\nA=0,0 G=2,2<a>"
    assert events == [
        ("generate", "pv", 3, False, prompt),
        ("parse", "vertical", "U"),
        ("score", "vertical", "U"),
        ("parse", "vertical", "D"),
        ("score", "vertical", "D"),
        ("parse", "vertical", " U"),
        ("score", "vertical", "U"),
        ("record", "vertical", 3),
        ("commit", "vertical", 1),
    ]
    assert [s.reward for s in episode.samples] == [-1.0, 1.0, -1.0]


def test_the_chosen_branchs_own_env_continues() -> None:
    events: list[tuple] = []
    episode = make_episode([["S", "U", "D"], ["L", "R", "S"]], events)
    start_env = episode.env
    chosen = asyncio.run(episode.act(VerticalMover()))
    candidates = episode.groups[0]
    assert chosen is candidates[2] and chosen.action == "D"
    # "S" is no mover's move: it stays an invalid candidate with the penalty and its own unchanged clone.
    assert [(c.valid, c.reward) for c in candidates] == [(False, -1.0), (True, -1.0), (True, 1.0)]
    assert episode.env is chosen.env and episode.env is not start_env
    assert episode.env.position == (1, 0) and start_env.position == (0, 0)
    assert [c.env.position for c in candidates] == [(0, 0), (0, 0), (1, 0)]
    assert len({id(c.env) for c in candidates} | {id(start_env)}) == 4
    # The next agent starts from that branch, and scoring it does not touch the committed env.
    second = asyncio.run(episode.act(HorizontalMover()))
    prompts = [e[4] for e in events if e[0] == "generate"]
    assert prompts[1].endswith("A=1,0 G=2,2<a>")
    assert candidates[2].env.position == (1, 0)
    assert episode.env is second.env and episode.env.position == (1, 1)


def test_second_agent_of_a_turn_is_scored_on_its_own_candidates() -> None:
    episode = make_episode([["D", "D", "D"], ["R", "L", "S", "Q"]], k=3)
    asyncio.run(episode.act(VerticalMover()))
    episode.k = 4
    asyncio.run(episode.act(HorizontalMover()))
    group = [s for s in episode.samples if s.agent == "horizontal"]
    assert {s.group for s in group} == {"it0/p0/0/horizontal/0"}
    # From (1, 0): R gets closer, L is blocked by the edge, S (not a mover's move) and Q do not parse.
    rewards = [s.reward for s in group]
    assert rewards == [1.0, -1.0, -1.0, -1.0] and np.var(rewards) > 0
    assert [s.valid for s in group] == [True, True, False, False]
    advantages = compute_advantages(episode.samples)
    assert np.all(advantages[:3] == 0) and np.any(advantages[3:] != 0)


def test_group_keys_never_merge_two_problems() -> None:
    other = {**OPEN, "seed": -2, "start": [0, 2], "goal": [2, 0]}
    first = make_episode([["D", "U", "S"]], episode_id="it0/p0/0", problem_id="p0")
    second = make_episode([["D", "D", "S"]], problem=other, episode_id="it0/p1/0", problem_id="p1")
    for episode in (first, second):
        asyncio.run(episode.act(VerticalMover()))
        episode.finish()
    keys = {s.group for s in first.samples}, {s.group for s in second.samples}
    assert keys == ({"it0/p0/0/vertical/0"}, {"it0/p1/0/vertical/0"})
    mixed = [s for pair in zip(first.samples, second.samples, strict=True) for s in pair]
    for grouping in ("agent_turn", "agent", "trajectory"):
        together = compute_advantages(mixed, grouping)
        apart = compute_advantages(first.samples, grouping), compute_advantages(second.samples, grouping)
        np.testing.assert_array_equal(together[0::2], apart[0])
        np.testing.assert_array_equal(together[1::2], apart[1])


def test_tie_break_is_seeded_and_not_always_the_first() -> None:
    def choice(episode_id: str, seed: int = 0) -> int:
        episode = make_episode([["D"] * 4], episode_id=episode_id, k=4, seed=seed)
        return asyncio.run(episode.act(VerticalMover())).index

    ids = [f"it0/p{i}/0" for i in range(20)]
    choices = [choice(i) for i in ids]
    assert choices == [choice(i) for i in ids]
    assert len(set(choices)) > 1
    assert [choice(i, seed=1) for i in ids] != choices


def test_invalid_candidates_are_kept_with_the_penalty() -> None:
    episode = make_episode([["X", "  ", "D"], ["Q", "U", "?"]])
    asyncio.run(episode.act(VerticalMover()))
    assert [(s.valid, s.reward) for s in episode.samples] == [(False, -1.0), (False, -1.0), (True, 1.0)]
    assert "expected one of" in episode.samples[0].info["error"]
    assert [c.env.position for c in episode.groups[0]] == [(0, 0), (0, 0), (1, 0)]
    # A turn where nothing is better than a penalty still commits a candidate and goes on.
    episode.next_turn()
    chosen = asyncio.run(episode.act(HorizontalMover()))
    assert len(episode.samples) == 6 and not chosen.valid and episode.env.position == (1, 0)


def test_an_episode_spanning_a_weight_update_stamps_each_sample_with_its_own_version() -> None:
    """Bounded staleness: a weight update may land between two requests of one episode; each sample
    carries the version of the request that produced it, and the summary counts the episode's tokens
    as generated under more than one version."""
    scripts = [["D", "D"], ["R", "S"], ["D", "U"], ["R", "L"]]
    episode = make_episode(scripts, k=2)
    episode.generate = FakeGenerate(scripts, [], versions=[3, 3, 4, 4])
    workflow = PlanPathWorkflow({"vertical": VerticalMover(), "horizontal": HorizontalMover()})
    asyncio.run(workflow.run(episode))
    summary = episode.finish()
    assert [s.version for s in episode.samples] == [3, 3, 3, 3, 4, 4, 4, 4]
    assert summary["multi_version_tokens"] == summary["tokens"] == 16


def test_workflow_episode_return_and_summary() -> None:
    scripts = [["D", "D"], ["R", "S"], ["D", "U"], ["R", "L"]]
    events: list[tuple] = []
    episode = make_episode(scripts, events, k=2, alpha=1.0)
    workflow = PlanPathWorkflow({"vertical": VerticalMover(), "horizontal": HorizontalMover()})
    asyncio.run(workflow.run(episode))
    summary = episode.finish()
    assert [e[0] for e in events].count("generate") == 4
    assert summary == {
        "success": True,
        "reward/vertical": 0.5,
        "reward/horizontal": 0.25,
        "parse/invalid_rate/vertical": 0.0,
        "parse/invalid_rate/horizontal": 0.25,
        "progress_rate/vertical": 1.0,  # every committed move shortened the distance (see below)
        "progress_rate/horizontal": 1.0,
        "turns": 2,
        "tokens": 16,
        "multi_version_tokens": 0,  # every completion came from version 3
    }
    # alpha * 1 (goal) + four committed moves of +1 each.
    assert {s.episode_return for s in episode.samples} == {5.0}
    assert [s.reward for s in episode.samples][-2:] == [2.0, -1.0]
    # The horizontal mover's "S" at turn 0 is an invalid candidate with the penalty.
    assert [s.valid for s in episode.samples] == [True, True, True, False, True, True, True, True]
    assert [s.reward for s in episode.samples][2:4] == [1.0, -1.0]
    assert sorted({s.group for s in episode.samples}) == [
        "it0/p0/0/horizontal/0",
        "it0/p0/0/horizontal/1",
        "it0/p0/0/vertical/0",
        "it0/p0/0/vertical/1",
    ]
    sample = episode.samples[0]
    assert sample.policy == "pv" and sample.version == 3 and sample.problem_id == "p0"
    assert sample.completion_ids.dtype == np.int32 and sample.logprobs.dtype == np.float32


def test_each_group_is_handed_on_as_it_is_recorded_when_groups_stream_by_turn() -> None:
    """`Episode.on_group` (set by the env worker under `Config.streams_turns`) gets each group's samples when it
    is recorded, before the next turn is sampled, and `streamed` says how many samples it was given."""
    scripts = [["D", "D"], ["R", "S"], ["D", "U"], ["R", "L"]]
    events: list[tuple] = []
    episode = make_episode(scripts, events, k=2)
    handed: list[tuple[list[str], int]] = []
    episode.on_group = lambda samples: handed.append(
        ([s.group for s in samples], [e[0] for e in events].count("generate"))
    )
    workflow = PlanPathWorkflow({"vertical": VerticalMover(), "horizontal": HorizontalMover()})
    asyncio.run(workflow.run(episode))
    episode.finish()
    assert [(groups[0], len(groups), calls) for groups, calls in handed] == [
        ("it0/p0/0/vertical/0", 2, 1), ("it0/p0/0/horizontal/0", 2, 2),
        ("it0/p0/0/vertical/1", 2, 3), ("it0/p0/0/horizontal/1", 2, 4),
    ]  # fmt: skip
    assert episode.streamed == len(episode.samples) == 8


def test_parse_failure_rate_per_agent() -> None:
    """`parse/invalid_rate/<agent>`: the fraction of the agent's candidates that did not parse."""
    episode = make_episode([["X", "  ", "D"], ["Q", "R", "?"]], k=3)
    asyncio.run(episode.act(VerticalMover()))
    asyncio.run(episode.act(HorizontalMover()))
    summary = episode.finish()
    assert summary["parse/invalid_rate/vertical"] == pytest.approx(2 / 3)
    assert summary["parse/invalid_rate/horizontal"] == pytest.approx(2 / 3)


def test_workflow_stops_after_max_turns() -> None:
    events: list[tuple] = []
    # D, R, U, L: there and back again, so the four local rewards (+1, +1, -1, -1) sum to zero.
    episode = make_episode([["D"], ["R"], ["U"], ["L"]], events, k=1)
    nodes = {"vertical": VerticalMover(), "horizontal": HorizontalMover()}
    asyncio.run(PlanPathWorkflow(nodes, max_turns=2).run(episode))
    summary = episode.finish()
    assert [e[0] for e in events].count("generate") == 4
    assert summary["turns"] == 2 and not summary["success"] and episode.env.position == (0, 0)
    assert {s.episode_return for s in episode.samples} == {0.0}


def test_eval_mode_is_greedy_single_and_records_no_samples() -> None:
    events: list[tuple] = []
    episode = make_episode([["D"]], events, mode="eval", k=4)
    asyncio.run(episode.act(VerticalMover()))
    assert events[0][2:4] == (1, True)
    assert episode.samples == []
    assert episode.finish() == {
        "success": False,
        "reward/vertical": 1.0,
        "parse/invalid_rate/vertical": 0.0,
        "progress_rate/vertical": 1.0,
        "turns": 1,
        "tokens": 2,
        "multi_version_tokens": 0,
    }


def test_batch_encoding_prompt_ids_are_flattened() -> None:
    episode = make_episode([["D"]], k=1, tokenizer=FakeTokenizer(batch_encoding=True))
    asyncio.run(episode.act(VerticalMover()))
    prompt_ids = episode.samples[0].prompt_ids
    assert prompt_ids.dtype == np.int32 and prompt_ids.ndim == 1 and chr(prompt_ids[0]) == "<"


def test_mistakes_get_clear_errors() -> None:
    episode = make_episode([["D"], ["D"]], k=1)
    asyncio.run(episode.act(VerticalMover()))
    with pytest.raises(ValueError, match="next_turn"):
        asyncio.run(episode.act(VerticalMover()))
    with pytest.raises(ValueError, match="no policy serves agent 'scout'"):
        asyncio.run(episode.sample(Node("scout"), 1))
    with pytest.raises(ValueError, match="mode"):
        make_episode([], mode="test")


def docstring_code(cls: type) -> str:
    """The indented example at the end of `cls`'s docstring."""
    lines = (cls.__doc__ or "").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(" " * 8))
    return textwrap.dedent("\n".join(lines[start:]))


def test_docstring_toys_run_as_an_episode() -> None:
    scope: dict[str, Any] = {"Env": Env, "check_split": check_split, "Node": Node, "ParseError": ParseError}
    scope["Workflow"] = Workflow
    for cls in (Env, Node, Workflow):
        exec(docstring_code(cls), scope)
    env = scope["Echo"]()
    env.reset(options={"problem": scope["Echo"].problems("train", 1)[0]})
    events: list[tuple] = []
    episode = Episode(
        episode_id="e",
        problem_id="echo/0",
        env=env,
        policy_of={"speaker": "pi"},
        tokenizers={"pi": FakeTokenizer()},
        generate=FakeGenerate([["w0", "W0", ""]], events),
        k=3,
        alpha=1.0,
    )
    asyncio.run(scope["workflow"].run(episode))
    assert [s.reward for s in episode.samples] == [0.0, 1.1, -1.0]
    assert episode.finish()["success"] and episode.env.said == "W0"
