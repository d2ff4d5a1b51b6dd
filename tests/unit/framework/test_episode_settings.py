"""The episode owns K, the sampling mode and greedy decoding: one place decides them for the router
and the env worker (eval is greedy unless eval.greedy is false; parallel sampling runs K episodes)."""

from __future__ import annotations

from mas_async.config import load_config
from mas_async.rollout.episode import candidates_per_turn, episodes_per_problem, greedy_decoding
from tests.support.paths import ROOT


def _config(*overrides: str):
    return load_config(ROOT / "configs/plan_path_tiny.yaml", list(overrides))


def test_tree_sampling_takes_k_candidates_per_turn_in_one_episode():
    config = _config("algorithm.k=6")
    assert candidates_per_turn(config, "train") == 6 and episodes_per_problem(config, "train") == 1
    assert candidates_per_turn(config, "eval") == 1


def test_parallel_sampling_runs_k_episodes_of_one_candidate():
    config = _config("algorithm.k=6", "algorithm.sampling=parallel", "algorithm.grouping=trajectory")
    assert candidates_per_turn(config, "train") == 1 and episodes_per_problem(config, "train") == 6


def test_eval_is_greedy_by_default_and_sampled_when_asked():
    assert greedy_decoding(_config(), "eval") and not greedy_decoding(_config(), "train")
    sampled = _config("eval.greedy=false", "eval.k=4")
    assert not greedy_decoding(sampled, "eval") and episodes_per_problem(sampled, "eval") == 4
