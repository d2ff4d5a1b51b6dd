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


def test_best_file_is_replaced_atomically(tmp_path):
    save_best(tmp_path, 5, 0.5)
    save_best(tmp_path, 15, 0.75)
    assert json.loads((tmp_path / "checkpoints" / "best.json").read_text()) == {"version": 15, "score": 0.75}
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
