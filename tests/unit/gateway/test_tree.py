"""Tree sampling of a workflow program's calls (mas_async/gateway/tree.py): a training call is K candidates
from one request, the scorer scores each, the program gets the best, every candidate is a sample of its
(episode, agent, turn) group credited with its score, and the agent's transcript goes on from the chosen
one; evaluation is not tree-sampled; n > 1, text completions and a failing scorer are refused or fail the
episode in a sentence. A scripted engine answers the K candidates of a request with different moves."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import numpy as np
import openai
import pytest

from envs.plan_path import PlanPathEnv
from mas_async.gateway.episode import GatewayEpisode
from mas_async.gateway.tree import ScoreError, TreeSampling, best
from mas_async.gateway.workflow import ProgramError, load_scorer
from mas_async.tiny_model import IM_END_ID, build_tokenizer
from mas_async.wire.samples import Completion
from tests.unit.gateway.fakes import LIMITS, FakeInference, plan_path_env, play_program

MOVES = ["U", "D", "L", "R"]
"""The scripted engine's K = 4 candidates of every request, in order."""
SCORES = {"U": 0.0, "D": 1.0, "L": 1.0, "R": -1.0}
"""The test scorer's scores: D and L tie for best, so D (the first of them) is chosen."""
TREE = TreeSampling(k=4, scorer="nodes.examples.openai_movers:score", timeout_s=5.0)
GO = [{"role": "user", "content": "GO"}]


class Candidates(FakeInference):
    """Answers a request for n choices with the first n of `texts` (each + <|im_end|>), at version 7."""

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        super().__init__(tokenizer)
        self.texts = texts

    async def __call__(
        self, policy, prompt_ids, n, greedy, *, max_tokens, temperature, seed=None, top_logprobs=0
    ) -> list[Completion]:
        self.requests.append({"policy": policy, "prompt_ids": prompt_ids.tolist(), "n": n, "greedy": greedy})
        assert n <= len(self.texts), "the script holds fewer candidates than asked"
        out = []
        for index, text in enumerate(self.texts[:n]):
            ids = np.asarray([*self.tokenizer.encode(text, add_special_tokens=False), IM_END_ID], dtype=np.int32)
            out.append(Completion(ids, np.full(len(ids), -0.1 * (index + 1), np.float32), 7, "stop"))
        return out

    def ids(self, text: str) -> list[int]:
        return [*self.tokenizer.encode(text, add_special_tokens=False), IM_END_ID]


class Scorer:
    """Scores a candidate by its move (`scores`), and records every call's arguments."""

    def __init__(self, scores: dict[str, Any] | None = None) -> None:
        self.scores = SCORES if scores is None else scores
        self.calls: list[tuple[Any, str, list[dict[str, Any]], dict[str, Any]]] = []

    async def __call__(self, task: Any, agent: str, messages: list[dict[str, Any]], choice: dict[str, Any]) -> Any:
        self.calls.append((task, agent, messages, choice))
        return self.scores[choice["content"]]


def play(
    program: Any, scorer: Any, mode: str = "train", tree: TreeSampling = TREE
) -> tuple[GatewayEpisode, Candidates]:
    """Play one episode of `program` through a started gateway that tree-samples training calls with
    `scorer`; the engine answers every request's candidates with MOVES. Bounded: never hangs."""
    fake = Candidates(build_tokenizer(), MOVES)
    limits = dataclasses.replace(LIMITS, max_calls=64, tree=tree)
    return play_program(program, fake, limits=limits, mode=mode, scorer=scorer), fake


def two_calls(replies: list[Any]) -> Any:
    """A program that makes two calls of the vertical mover, the second after the first's reply."""

    async def program(task: Any, agents: dict[str, Any]) -> dict[str, Any]:
        chat = list(GO)
        first = await agents["vertical"].chat.completions.create(model="vertical", messages=chat)
        chat += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "ON"}]
        second = await agents["vertical"].chat.completions.create(model="vertical", messages=chat)
        replies.extend([first, second])
        return {"team": 0.5, "local": {"vertical": 3.0}, "success": True}

    return program


def test_the_best_candidate_is_returned_and_every_candidate_is_a_sample_with_its_score() -> None:
    replies: list[Any] = []
    scorer = Scorer()
    episode, fake = play(two_calls(replies), scorer)
    # One request of n = K per call; the program got one choice, the best (D: L ties with it, later).
    assert [r["n"] for r in fake.requests] == [4, 4]
    for reply in replies:
        assert len(reply.choices) == 1 and reply.choices[0].index == 0
        assert reply.choices[0].message.content == "D" and reply.choices[0].token_ids == fake.ids("D")
        assert reply.model_extra["mas_async"]["tree"] == {"scores": [0.0, 1.0, 1.0, -1.0], "chosen": 1}
    # The scorer saw each candidate's assistant message after the call's messages, with the episode's task.
    assert [(agent, choice) for _, agent, _, choice in scorer.calls] == [
        ("vertical", {"role": "assistant", "content": move}) for _ in range(2) for move in MOVES
    ]
    assert all(task.episode_id == "train0-3" and task.env is episode.env for task, *_ in scorer.calls)
    assert scorer.calls[0][2] == GO and scorer.calls[4][2][:2] == [*GO, {"role": "assistant", "content": "D"}]
    # All K candidates of each call are samples of the call's group, each credited with its own score.
    samples = episode.samples
    assert [s.group for s in samples] == ["train0-3/vertical/0"] * 4 + ["train0-3/vertical/1"] * 4
    assert [s.reward for s in samples] == [SCORES[m] for m in MOVES] * 2
    assert [s.info["chosen"] for s in samples] == [False, True, False, False] * 2
    assert [s.info["index"] for s in samples] == [0, 1, 2, 3] * 2
    assert [s.completion_ids.tolist() for s in samples] == [fake.ids(m) for m in MOVES] * 2
    assert all(s.prompt_ids.tolist() == fake.requests[s.turn]["prompt_ids"] for s in samples)
    assert all(s.logprobs.tolist() == pytest.approx([-0.1 * (s.info["index"] + 1)] * 2) for s in samples)
    assert {s.episode_return for s in samples} == {2.0 * 0.5 + 3.0}
    # The next call's prompt is the first call's prompt and the CHOSEN candidate's ids, reused exactly.
    first_prompt, second_prompt = (r["prompt_ids"] for r in fake.requests)
    chosen = first_prompt + fake.ids("D")
    assert second_prompt[: len(chosen)] == chosen and len(second_prompt) > len(chosen)
    assert [s.info["prompt_source"] for s in samples] == ["fresh"] * 4 + ["reused"] * 4
    summary = episode.finish()
    assert summary["gateway/calls/vertical"] == 2 and summary["gateway/reused/vertical"] == 1
    assert summary["gateway/score/vertical"] == pytest.approx(0.25) and "gateway/score/horizontal" not in summary
    assert summary["reward/vertical"] == 2.0 * 0.5 + 3.0  # the program's rewards, as in evaluation
    assert summary["tokens"] == 2 * sum(len(fake.ids(m)) for m in MOVES)


def test_a_candidate_that_another_candidate_beats_is_not_the_history_the_next_call_reuses() -> None:
    """A program that sends back a candidate it was not given edits its history (counted), as for any
    invented reply: only the returned candidate continues the transcript."""

    async def program(task: Any, agents: dict[str, Any]) -> None:
        await agents["vertical"].chat.completions.create(model="vertical", messages=GO)
        chat = [*GO, {"role": "assistant", "content": "U"}, {"role": "user", "content": "ON"}]  # a losing candidate
        await agents["vertical"].chat.completions.create(model="vertical", messages=chat)

    episode, _ = play(program, Scorer())
    summary = episode.finish()
    assert summary["gateway/prefix_mismatch/vertical"] == 1 and summary["gateway/reused/vertical"] == 0


def test_ties_go_to_the_first_candidate() -> None:
    assert best([0.0, 1.0, 1.0, -1.0]) == 1 and best([2.0, 2.0]) == 0 and best([-3.0]) == 0
    replies: list[Any] = []
    episode, _ = play(two_calls(replies), Scorer(dict.fromkeys(MOVES, 0.5)))
    assert [r.choices[0].message.content for r in replies] == ["U", "U"]
    assert [s.info["chosen"] for s in episode.samples] == [True, False, False, False] * 2


def test_evaluation_is_not_tree_sampled() -> None:
    replies: list[Any] = []
    scorer = Scorer()
    episode, fake = play(two_calls(replies), scorer, mode="eval")
    assert [r["n"] for r in fake.requests] == [1, 1] and scorer.calls == [] and episode.samples == []
    assert [r.choices[0].message.content for r in replies] == ["U", "U"]
    assert "tree" not in replies[0].model_extra["mas_async"]
    assert "gateway/score/vertical" not in episode.finish()


def test_a_streamed_call_streams_the_chosen_candidate() -> None:
    chunks: list[Any] = []

    async def program(task: Any, agents: dict[str, Any]) -> None:
        stream = await agents["vertical"].chat.completions.create(model="vertical", messages=GO, stream=True)
        chunks.extend([chunk async for chunk in stream])

    episode, _ = play(program, Scorer())
    assert {c.choices[0].index for c in chunks} == {0}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "D"
    assert chunks[-1].model_extra["mas_async"]["tree"]["chosen"] == 1
    assert len(episode.samples) == 4 and [s.info["chosen"] for s in episode.samples] == [False, True, False, False]


def test_n_above_one_and_text_completions_are_refused_under_tree_sampling() -> None:
    errors: list[openai.BadRequestError] = []

    async def program(task: Any, agents: dict[str, Any]) -> None:
        client = agents["vertical"]
        for call in (
            client.chat.completions.create(model="vertical", messages=GO, n=2),
            client.completions.create(model="vertical", prompt="GO"),
        ):
            try:
                await call
            except openai.BadRequestError as e:
                errors.append(e)

    episode, fake = play(program, Scorer())
    assert len(errors) == 2 and fake.requests == [] and episode.samples == []
    n, text = (e.body for e in errors)
    assert n["param"] == "n" and "algorithm.sampling=tree" in n["message"] and "ask one choice" in n["message"]
    assert "/v1/completions" in text["message"] and "use chat completions" in text["message"]
    assert episode.finish()["gateway/calls/vertical"] == 0  # a refused call takes no turn


async def _raises(task: Any, agent: str, messages: Any, choice: dict[str, Any]) -> float:
    if choice["content"] == "L":
        raise KeyError("a bug in the scorer")
    return 0.0


async def _slow(task: Any, agent: str, messages: Any, choice: dict[str, Any]) -> float:
    await asyncio.sleep(30)
    return 0.0


@pytest.mark.parametrize(
    ("scorer", "match"),
    [
        (
            _raises,
            "candidate 2 of turn 0 of agent 'vertical' .episode train0-3. raised KeyError: 'a bug in the scorer'",
        ),
        (Scorer(dict.fromkeys(MOVES, math.nan)), "returned nan: a scorer returns a finite number"),
        (Scorer(dict.fromkeys(MOVES, math.inf)), "returned inf"),
        (Scorer(dict.fromkeys(MOVES, "high")), "returned 'high'"),
        (Scorer(dict.fromkeys(MOVES, True)), "returned True"),
        (_slow, r"did not return within 0.2s \(rollout.request_timeout_s\)"),
    ],
)
def test_a_failing_scorer_fails_its_episode_with_a_sentence(scorer: Any, match: str) -> None:
    seen: list[Exception] = []

    async def program(task: Any, agents: dict[str, Any]) -> None:
        try:
            await agents["vertical"].chat.completions.create(model="vertical", messages=GO)
        except openai.InternalServerError as e:
            seen.append(e)
        # A program that goes on after its call's error: its next call is refused too.
        try:
            await agents["horizontal"].chat.completions.create(model="horizontal", messages=GO)
        except openai.InternalServerError as e:
            seen.append(e)

    with pytest.raises(ScoreError, match=match):
        play(program, scorer, tree=dataclasses.replace(TREE, timeout_s=0.2))
    assert [e.status_code for e in seen] == [500, 500]
    assert seen[0].body["code"] == "scorer_failed" and "the episode failed: workflow.scorer" in seen[0].body["message"]
    assert "has failed" in seen[1].body["message"]


def test_a_program_that_raises_on_the_scorers_failure_fails_with_the_scorers_error() -> None:
    async def program(task: Any, agents: dict[str, Any]) -> None:
        await agents["vertical"].chat.completions.create(model="vertical", messages=GO)  # raises its 500

    with pytest.raises(ScoreError, match="raised KeyError"):
        play(program, _raises)


def test_the_scorer_is_loaded_from_module_function_or_refused_with_a_sentence() -> None:
    from nodes.examples.openai_movers import score

    assert load_scorer("nodes.examples.openai_movers:score") is score
    for path, match in [
        (
            "nodes.examples.openai_movers",
            "workflow.scorer is 'nodes.examples.openai_movers': give it as 'module:function'",
        ),
        ("nodes.examples.openai_movers:nothing", "workflow.scorer .* has no attribute 'nothing'"),
        (
            "nodes.examples.openai_movers:MOVES",
            r"not an async function \(async def MOVES\(task, agent, messages, choice\)",
        ),
    ]:
        with pytest.raises(ProgramError, match=match):
            load_scorer(path)
    with pytest.raises(ModuleNotFoundError):  # an import error is the module's own
        load_scorer("nodes.examples.no_such_module:score")


def test_the_example_scorer_scores_a_move_on_a_clone() -> None:
    from nodes.examples.openai_movers import score

    env = plan_path_env()
    task = _task(env)
    before = (env.position, env.distance())
    scores = {move: asyncio.run(score(task, "vertical", GO, {"role": "assistant", "content": move})) for move in "UDx"}
    assert (env.position, env.distance()) == before, "the scorer plays on a clone"
    assert scores["x"] == -1.0 and {scores["U"], scores["D"]} <= {-1.0, 0.0, 1.0, 2.0}
    clone = env.clone()
    clone.step("vertical", "D")
    expected = -1.0 if clone.infos["vertical"]["blocked"] else float(env.distance() - clone.distance())
    assert scores["D"] == clone.team_reward() + expected


def _task(env: PlanPathEnv) -> Any:
    from mas_async.gateway.episode import Task

    return Task(env=env, problem={}, observation={}, agents=("vertical", "horizontal"), episode_id="e", mode="train")
