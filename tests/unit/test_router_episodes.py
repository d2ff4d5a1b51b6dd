"""The router's episode plan per iteration: tree sampling (one episode per problem), parallel sampling
(K independent episodes per problem, same problem id), eval.k episodes per test problem; the data
order depends only on the seed and the iteration (what a resumed run relies on)."""

from __future__ import annotations

from collections import Counter

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.router import Router
from tests.integration.launch import ROOT


def _router(tmp_path, *overrides):
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["env.train_size=64", "env.test_size=8", *overrides])
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 2}, {"vertical": "", "horizontal": ""})
    tmp_path.mkdir(parents=True, exist_ok=True)
    return Router(config, deployment, tmp_path)


def test_tree_sampling_runs_one_episode_per_problem(tmp_path):
    tasks = _router(tmp_path, "rollout.batch_size=5")._episodes(3, 3, train=True, evaluate=False)
    assert len(tasks) == 5 and len({t.msg.problem_id for t in tasks}) == 5
    assert all(t.msg.mode == "train" and t.msg.version == 3 and t.msg.iteration == 3 for t in tasks)


def test_parallel_sampling_runs_k_episodes_per_problem(tmp_path):
    router = _router(tmp_path, "rollout.batch_size=5", "algorithm.sampling=parallel", "algorithm.grouping=agent",
                     "algorithm.k=4")  # fmt: skip
    tasks = router._episodes(0, 0, train=True, evaluate=False)
    assert len(tasks) == 20
    assert set(Counter(t.msg.problem_id for t in tasks).values()) == {4}
    assert len({t.msg.episode_id for t in tasks}) == 20 and len({t.msg.seed for t in tasks}) == 20


def test_eval_k_episodes_per_test_problem(tmp_path):
    router = _router(tmp_path, "eval.size=6", "eval.k=3", "eval.greedy=false")
    tasks = router._episodes(0, 0, train=False, evaluate=True)
    assert len(tasks) == 18 and set(Counter(t.msg.problem_id for t in tasks).values()) == {3}
    assert all(t.msg.problem_id.startswith("test") for t in tasks)


def test_data_order_depends_on_seed_and_iteration_only(tmp_path):
    a = [t.msg.problem_id for t in _router(tmp_path / "a")._episodes(7, 7, train=True, evaluate=False)]
    b = [t.msg.problem_id for t in _router(tmp_path / "b")._episodes(7, 7, train=True, evaluate=False)]
    c = [t.msg.problem_id for t in _router(tmp_path / "c", "run.seed=1")._episodes(7, 7, train=True, evaluate=False)]
    assert a == b and a != c
