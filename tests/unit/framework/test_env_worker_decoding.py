"""The env worker asks for greedy generation in evaluation (unless eval.greedy is false) and for K
sampled candidates in training: its requests are recorded by a fake generate, no processes."""

from __future__ import annotations

import asyncio

import numpy as np

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.rollout.env_worker import EnvWorker
from mas_async.wire.messages import EpisodeDone, RunEpisode
from mas_async.wire.samples import Completion
from tests.support.paths import ROOT


def _requests(tiny_model, mode: str, *overrides: str) -> tuple[list[tuple[int, bool]], EpisodeDone]:
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
    asyncio.run(worker._run_episode(RunEpisode("e0", 0, mode, 0, "p0", problem, 0, 0)))
    return calls, sent[-1]


def test_eval_is_greedy_with_one_candidate(tiny_model):
    calls, done = _requests(tiny_model, "eval")
    assert calls and set(calls) == {(1, True)} and done.error == "" and done.attempt == 0


def test_eval_samples_when_eval_greedy_is_false(tiny_model):
    calls, _ = _requests(tiny_model, "eval", "eval.greedy=false")
    assert calls and set(calls) == {(1, False)}


def test_training_samples_k_candidates(tiny_model):
    calls, _ = _requests(tiny_model, "train")
    assert calls and set(calls) == {(3, False)}
