"""A tree-sampled workflow program in the env worker (no processes): the router runs one episode per
problem and says so (`problem_episodes`, what a streamed step waits for); the worker's Groups of that
episode hold K samples per call of the example program, scored by the example scorer, one chosen per
group; a failing scorer fails the episode in EpisodeDone.error, and the worker lives on."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import numpy as np

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.rollout.env_worker import EnvWorker
from mas_async.router.hub import Router
from mas_async.wire.messages import EpisodeDone, Groups, RunEpisode, samples_from_wire
from mas_async.wire.samples import Completion
from tests.support.paths import ROOT

CONFIG = ROOT / "configs" / "examples" / "openai_movers_tree.yaml"
MOVES = ["U", "D", "L", "x"]
"""The scripted candidates of every request: each mover has one or two moves among them, "x" is unreadable."""


def test_the_router_runs_one_episode_per_problem_and_says_so(tmp_path) -> None:
    config_overrides = ["env.train_size=64", "rollout.batch_size=5"]
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 2}, {"vertical": "", "horizontal": ""})
    router = Router(load_config(CONFIG, config_overrides), deployment, tmp_path)
    tasks = list(router._episodes(0, 0, train=True, evaluate=False))
    assert len(tasks) == 5 and len({t.msg.problem_id for t in tasks}) == 5
    assert {t.msg.problem_episodes for t in tasks} == {1}


def _episode(tiny_model, *overrides: str, scorer: Any = None) -> tuple[list[int], list]:
    """Run one training episode of the example program in an EnvWorker whose gateway's inference answers
    every request's candidates with MOVES; the n of each request, and every message the worker sent."""
    config = load_config(CONFIG, ["algorithm.k=4", "workflow.options.max_turns=2", *overrides])
    paths = {"vertical": str(tiny_model), "horizontal": str(tiny_model)}
    worker = EnvWorker(config, Deployment("tcp://127.0.0.1:1", {}, paths), 0)
    asked: list[int] = []
    sent: list = []

    async def generate(policy: str, prompt_ids: np.ndarray, n: int, greedy: bool, **_: Any) -> list[Completion]:
        asked.append(n)
        stop = worker.stop_ids[policy][0]
        tokenizer = worker.tokenizers[policy]
        return [
            Completion(np.asarray([*tokenizer.encode(m, add_special_tokens=False), stop], np.int32),
                       np.full(2, -0.5, np.float32), 0, "stop")
            for m in MOVES[:n]
        ]  # fmt: skip

    assert worker.gateway is not None
    worker.gateway.generate = generate
    if scorer is not None:
        worker.gateway.scorer = scorer
    worker.send = sent.append
    problem = worker.env_cls.problems("train", 1, **config.env.options)[0]

    async def main() -> None:
        await worker.gateway.start()
        try:
            await asyncio.wait_for(worker._run_episode(RunEpisode("e0", 0, "train", 0, "p0", problem, 0, 0, 1)), 60)
        finally:
            await worker.gateway.stop()

    asyncio.run(main())
    return asked, sent


def test_a_tree_sampled_episode_sends_k_samples_per_call_of_one_episode(tiny_model) -> None:
    asked, sent = _episode(tiny_model)
    done = sent[-1]
    assert isinstance(done, EpisodeDone) and done.error == "", done.error
    groups = [m for m in sent if isinstance(m, Groups)]
    assert {g.policy for g in groups} == {"vertical", "horizontal"}
    assert all(g.problem_episodes == 1 for g in groups)
    samples = [s for g in groups for s in samples_from_wire(g.samples)]
    assert asked and set(asked) == {4} and len(samples) == 4 * len(asked) == sum(g.n_samples for g in groups)
    by_group: dict[str, list] = defaultdict(list)
    for sample in samples:
        by_group[sample.group].append(sample)
    for key, group in by_group.items():
        agent, turn = key.split("/")[1], int(key.split("/")[2])
        assert key == f"e0/{agent}/{turn}" and len(group) == 4, key
        assert all(s.episode_id == "e0" and s.problem_id == "p0" and s.agent == agent for s in group)
        rewards = [s.reward for s in group]
        chosen = [s.info["chosen"] for s in group]
        assert chosen.count(True) == 1 and chosen.index(True) == rewards.index(max(rewards)), key
        assert rewards[3] == -1.0  # "x" is no move
    assert done.summary["gateway/calls/vertical"] >= 1
    assert "gateway/score/vertical" in done.summary


def test_a_failing_scorer_fails_the_episode_not_the_worker(tiny_model) -> None:
    async def fails(task: Any, agent: str, messages: Any, choice: Any) -> float:
        raise RuntimeError("the scorer's bug")

    _, sent = _episode(tiny_model, scorer=fails)
    assert not [m for m in sent if isinstance(m, Groups)]
    done = sent[-1]
    assert isinstance(done, EpisodeDone)
    assert done.error.startswith(
        "ScoreError: workflow.scorer on candidate 0 of turn 0 of agent 'vertical' (episode e0)"
    )
    assert "raised RuntimeError: the scorer's bug" in done.error
