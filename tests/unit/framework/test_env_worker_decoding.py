"""The env worker asks for greedy generation in evaluation (unless eval.greedy is false) and for K
sampled candidates in training: its requests are recorded by a fake generate, no processes; its Groups carry
the count of their problem's episodes."""

from __future__ import annotations

import asyncio

import numpy as np

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.rollout.env_worker import EnvWorker
from mas_async.wire.messages import Groups, RunEpisode
from mas_async.wire.samples import Completion
from tests.support.paths import ROOT


def _requests(tiny_model, mode: str, *overrides: str, problem_episodes: int = 1) -> tuple[list[tuple[int, bool]], list]:
    """The (n, greedy) of every generate call of one episode, and every message the worker sent."""
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["algorithm.k=3", *overrides])
    paths = {"vertical": str(tiny_model), "horizontal": str(tiny_model)}
    worker = EnvWorker(config, Deployment("tcp://127.0.0.1:1", {}, paths), 0)
    calls: list[tuple[int, bool]] = []
    sent: list = []

    async def generate(policy: str, prompt_ids: np.ndarray, n: int, greedy: bool) -> list[Completion]:
        calls.append((n, greedy))
        token = np.array([worker.stop_ids[policy][0]], dtype=np.int32)
        return [Completion(token, np.zeros(1, dtype=np.float32), 0, "stop") for _ in range(n)]

    worker.generate = generate
    worker.send = sent.append
    problem = worker.env_cls.problems("test" if mode == "eval" else "train", 1, **config.env.options)[0]
    asyncio.run(worker._run_episode(RunEpisode("e0", 0, mode, 0, "p0", problem, 0, 0, problem_episodes)))
    return calls, sent


def test_eval_is_greedy_with_one_candidate(tiny_model):
    calls, sent = _requests(tiny_model, "eval")
    assert calls and set(calls) == {(1, True)} and sent[-1].error == "" and sent[-1].attempt == 0


def test_eval_samples_when_eval_greedy_is_false(tiny_model):
    calls, _ = _requests(tiny_model, "eval", "eval.greedy=false")
    assert calls and set(calls) == {(1, False)}


def test_training_samples_k_candidates(tiny_model):
    calls, _ = _requests(tiny_model, "train")
    assert calls and set(calls) == {(3, False)}


def test_groups_carry_the_episodes_of_their_problem(tiny_model):
    """The RunEpisode's count of its problem's episodes goes on in each Groups (a streamed step waits for
    that many before it computes the problem's samples)."""
    _, sent = _requests(tiny_model, "train", problem_episodes=3)
    groups = [m for m in sent if isinstance(m, Groups)]
    assert groups and all(g.problem_episodes == 3 and g.n_samples > 0 for g in groups)
