"""The first generation of a weight group is joined under one bound on every side: the trainer's rank 0 and
each server wait for the others as long as the run's start-up may take (`startup_bound_s`: servers compiling
their engines at once arrive minutes apart), not the broadcasts' `trainer.weight_sync_timeout_s`. A
re-formed generation, ordered once its replicas are up, keeps the broadcasts' bound."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from mas_async.config import load_config
from mas_async.deployment import Deployment, free_ports
from mas_async.inference.server import InferenceServer
from mas_async.startup import VLLM_START_TIMEOUT_S, startup_bound_s
from mas_async.weights.group import WeightGroupSpec
from mas_async.weights.sync import open_sender
from tests.support.paths import ROOT


def test_every_rank_joins_the_first_generation_within_the_startup_bound() -> None:
    deployment = Deployment("tcp://127.0.0.1:9", {"vertical": 1, "horizontal": 2}, {"vertical": "", "horizontal": ""})
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["policies.vertical.backend=vllm"])
    spec = WeightGroupSpec.of(config, deployment, "vertical")
    startup = config.cluster.startup_timeout_s + VLLM_START_TIMEOUT_S
    first = {rank: spec.join_args(rank)["join_timeout_s"] for rank in range(spec.world_size)}
    assert first == dict.fromkeys(range(spec.world_size), startup)  # the trainer's and every server's
    assert {spec.join_args(rank)["timeout_s"] for rank in range(spec.world_size)} == {spec.timeout_s}  # broadcasts
    assert spec.join_args(1, generation=2, world_size=2)["join_timeout_s"] == spec.timeout_s  # a re-formed one


def test_a_server_up_before_the_trainer_waits_for_it_past_the_broadcasts_bound(tiny_model) -> None:
    """The server's own join, as its main() runs it (its backend joins over gloo): it arrives first, the trainer
    1.5 s later, past the 0.5 s that bounds each broadcast but within the start-up bound (5 s)."""
    path = str(tiny_model)
    config = load_config(
        ROOT / "configs/plan_path_tiny.yaml",
        ["policies.vertical.backend=mock", "trainer.weight_sync_timeout_s=0.5", "cluster.startup_timeout_s=5"],
    )
    ports = free_ports("127.0.0.1", 2)
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": ports[0], "horizontal": ports[1]},
                            {"vertical": path, "horizontal": path}, weight_backends={"vertical": "gloo"})  # fmt: skip
    assert startup_bound_s(config) == 5.0
    server = InferenceServer(config, deployment, "vertical", 0)
    spec = server.weight_groups["vertical"]
    trainer: dict[str, Any] = {}

    def late_trainer() -> None:
        time.sleep(1.5)
        trainer["sender"] = open_sender(**spec.join_args(0))

    thread = threading.Thread(target=late_trainer, daemon=True)
    thread.start()
    joined = asyncio.run(server._join("vertical", 0, 1, spec.world_size, 0))
    thread.join(10)
    assert joined and server.generation["vertical"] == 0 and "sender" in trainer
    assert server.backend.receiver.group.timeout_s == 0.5  # each broadcast keeps its own bound
    trainer["sender"].group.close()
    server.backend.receiver.group.close()
