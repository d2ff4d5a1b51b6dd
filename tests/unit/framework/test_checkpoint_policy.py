"""Checkpoints by default: periodic, the newest few kept, and the best by held-out success kept besides
them (a crash late in a long run loses at most `checkpoint_every` iterations)."""

from __future__ import annotations

import json

from mas_async.checkpoint import (
    STATE,
    checkpoint_due,
    complete_versions,
    latest_complete,
    load_best,
    policy_checkpoint,
    prune_checkpoints,
    save_best,
    save_router,
)
from mas_async.config import load_config
from tests.support.paths import ROOT

POLICIES = ["a", "b"]


def _checkpoint(run_dir, version: int, policies=POLICIES, router: bool = True) -> None:
    for policy in policies:
        folder = policy_checkpoint(run_dir, policy, version)
        folder.mkdir(parents=True)
        (folder / STATE).write_bytes(b"x")
    if router:
        save_router(run_dir, version, {"iteration": version})


def test_checkpoints_are_periodic_by_default():
    config = load_config(ROOT / "configs/plan_path_tiny.yaml")
    every = config.trainer.checkpoint_every
    assert every > 0 and config.trainer.keep_checkpoints > 0 and config.trainer.keep_best
    assert checkpoint_due(config, every) and checkpoint_due(config, 2 * every)
    assert not checkpoint_due(config, every + 1) and checkpoint_due(config, config.run.iterations)


def test_pruning_keeps_the_newest_and_the_best(tmp_path):
    for version in (10, 20, 30, 40, 50):
        _checkpoint(tmp_path, version)
    _checkpoint(tmp_path, 60, policies=["a"])  # incomplete (b missing): never counted, never deleted
    save_best(tmp_path, 20, 0.9)
    deleted = prune_checkpoints(tmp_path, POLICIES, keep=2)
    assert deleted == [10, 30]
    assert complete_versions(tmp_path, POLICIES) == [20, 40, 50] and latest_complete(tmp_path, POLICIES) == 50
    assert not policy_checkpoint(tmp_path, "a", 10).exists() and policy_checkpoint(tmp_path, "a", 60).exists()
    assert load_best(tmp_path) == {"version": 20, "score": 0.9}
    assert prune_checkpoints(tmp_path, POLICIES, keep=0) == []  # 0 keeps everything


def test_pruning_keeps_the_checkpoint_the_runs_processes_start_from(tmp_path):
    # A run restarted from v20 and trained on: a replica killed now starts again from v20 (deployment.json),
    # so v20 stays until the next whole-run restart (the soak's replicas failed to start, 400 times, without it).
    for version in (10, 20, 30, 40, 50):
        _checkpoint(tmp_path, version)
    assert prune_checkpoints(tmp_path, POLICIES, keep=1, starting={20}) == [10, 30, 40]
    assert complete_versions(tmp_path, POLICIES) == [20, 50] and policy_checkpoint(tmp_path, "b", 20).exists()
    assert prune_checkpoints(tmp_path, POLICIES, keep=1) == [20]  # (started from a newer one: it goes)


def test_a_process_whose_starting_checkpoint_is_gone_says_so(tmp_path):
    import pytest

    from mas_async.deployment import Deployment
    from mas_async.lora import starting_point

    gone = policy_checkpoint(tmp_path, "a", 20)
    deployment = Deployment(router_endpoint="tcp://127.0.0.1:1", weight_ports={}, model_paths={"a": str(tmp_path)})
    deployment.weights_paths = {"a": str(gone)}
    with pytest.raises(FileNotFoundError, match=r"policy a: the weights this process starts from, .*v000020, are gone"):
        starting_point(deployment, "a", None)
    _checkpoint(tmp_path, 20)
    assert starting_point(deployment, "a", None) == (str(gone), None)


def test_best_file_is_replaced_atomically(tmp_path):
    save_best(tmp_path, 5, 0.5)
    save_best(tmp_path, 15, 0.75)
    assert json.loads((tmp_path / "checkpoints" / "best.json").read_text()) == {"version": 15, "score": 0.75}
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
