"""The inference server's weight update with bounded staleness: a backend with a separate receive keeps
generating on the old weights while the broadcast is received, and swaps only between batches; in strict
mode the update drains first and requests wait for it."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.inference.server import InferenceServer
from mas_async.tiny_model import materialise
from mas_async.wire.messages import Generate
from mas_async.wire.samples import Completion
from tests.support.paths import ROOT


class _Backend:
    """Generates one token stamped with its version; the receive blocks until the test releases it."""

    concurrent = False

    def __init__(self) -> None:
        self.version = 0
        self.release = threading.Event()
        self.events: list[str] = []

    async def generate(self, requests):
        self.events.append(f"generate v{self.version}")
        return [[Completion(np.array([5], np.int32), np.array([-1.0], np.float32), self.version)] for _ in requests]

    def receive_weights(self, version):
        self.events.append(f"receive v{version} begins")
        assert self.release.wait(5), "the test never released the receive"
        self.events.append(f"receive v{version} ends")
        return [("w", version)]

    def apply_weights(self, version, tensors):
        self.events.append(f"apply v{version}")
        self.version = version

    def update_weights(self, version):
        self.apply_weights(version, self.receive_weights(version))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(materialise("builtin:tiny-char", tmp_path_factory.mktemp("models")))


def _server(model_path, staleness: int) -> tuple[InferenceServer, _Backend, list]:
    config = load_config(
        ROOT / "configs/plan_path_tiny.yaml", [f"rollout.max_staleness={staleness}", "policies.vertical.backend=mock"]
    )
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 2}, {"vertical": model_path,
                            "horizontal": model_path}, training=False)  # fmt: skip
    server = InferenceServer(config, deployment, "vertical", 0)
    backend = _Backend()
    server.backend = backend
    server.overlap_updates = staleness > 0 and hasattr(backend, "receive_weights")
    server.generation["vertical"] = 0  # as if it joined the weight group's first generation
    sent: list = []
    server.send = sent.append
    return server, backend, sent


def _request(i: int) -> Generate:
    return Generate(i, "vertical", "env_worker/0", 1e12, np.array([1, 2], np.int32), 1, 1, 1.0, 1.0, False, [])


async def _serve(server: InferenceServer, i: int) -> None:
    await server.gate.acquire_read()  # what the batch loop does before `_serve`
    await server._serve([_request(i)])


def test_stale_mode_generates_during_the_receive_and_swaps_between_batches(model_path):
    async def scenario():
        server, backend, sent = _server(model_path, staleness=1)
        update = asyncio.create_task(server._update("vertical", 1, 0))
        await asyncio.sleep(0.05)
        await asyncio.wait_for(_serve(server, 1), 2)  # served while v1 is being received
        backend.release.set()
        await asyncio.wait_for(update, 5)
        await _serve(server, 2)
        return backend.events, sent

    events, sent = asyncio.run(scenario())
    assert events == ["receive v1 begins", "generate v0", "receive v1 ends", "apply v1", "generate v1"]
    versions = [m.completions[0][2] for m in sent if hasattr(m, "completions")]
    assert versions == [0, 1]


def test_strict_mode_holds_requests_until_the_update_is_loaded(model_path):
    async def scenario():
        server, backend, _ = _server(model_path, staleness=0)
        update = asyncio.create_task(server._update("vertical", 1, 0))
        await asyncio.sleep(0.05)
        serve = asyncio.create_task(_serve(server, 1))
        await asyncio.sleep(0.05)
        assert not serve.done()  # waits for the update
        backend.release.set()
        await asyncio.wait_for(update, 5)
        await asyncio.wait_for(serve, 2)
        return backend.events

    assert asyncio.run(scenario()) == ["receive v1 begins", "receive v1 ends", "apply v1", "generate v1"]


def test_a_send_of_another_generation_is_ignored_and_a_retired_receive_reports_nothing(model_path):
    """After a re-form (generation 1), an UpdateWeights of generation 0 (in flight when the group was
    re-formed) is not received: the trainer sends again in generation 1. A receive abandoned because its
    generation was retired reports nothing either: no WeightsLoaded, no error, the weights unchanged."""
    from mas_async.weights.group import GroupRetired

    async def scenario():
        server, backend, sent = _server(model_path, staleness=0)
        server.generation["vertical"] = 1
        await asyncio.wait_for(server._update("vertical", 1, 0), 2)
        assert backend.events == [] and sent == []

        def retired(version):
            raise GroupRetired("generation 1 was retired")

        backend.receive_weights = retired
        await asyncio.wait_for(server._update("vertical", 1, 1), 2)
        assert sent == [] and backend.version == 0
        backend.release.set()
        del backend.receive_weights  # the class's own again
        await asyncio.wait_for(server._update("vertical", 1, 1), 5)
        assert [(m.version, m.error) for m in sent] == [(1, "")]

    asyncio.run(scenario())


def test_a_receive_broken_without_a_re_form_is_reported_after_the_weight_sync_bound(model_path):
    """A receive that broke while its generation was not retired waits for a re-form; if none is ordered
    within `trainer.weight_sync_timeout_s`, the error is reported (the router stops the run, named)."""
    from mas_async.weights.group import WeightSyncError

    async def scenario():
        server, backend, sent = _server(model_path, staleness=0)
        server.cfg.trainer.weight_sync_timeout_s = 0.2

        def broken(version):
            raise WeightSyncError("Connection closed by peer")

        backend.receive_weights = broken
        await asyncio.wait_for(server._update("vertical", 1, 0), 2)
        assert sent == []  # not yet: a re-form may follow
        await asyncio.sleep(0.5)
        return sent

    [report] = asyncio.run(scenario())
    assert report.version == 1 and "no re-formed weight group was ordered within 0.2s" in report.error
    assert "Connection closed by peer" in report.error
