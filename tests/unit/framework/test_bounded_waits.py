"""Every wait has a bound and a named error that says who was waited for (docs/faults.md): the router waiting
for its peers to join, a peer waiting for a silent router, an env worker waiting for a generate result, a
trainer's weight broadcast that no replica receives, a replica waiting for weights that never come, a
re-formed weight group that a rank never joins, a failed send that no re-form order follows, a backend's
generate that never returns and a call into vLLM that never finishes.
(The weight group's join: tests/integration/test_weight_sync.py; the step barrier: test_faults.py.)"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
import zmq

from mas_async.config import load_config
from mas_async.deployment import Deployment, free_ports
from mas_async.router.hub import Router
from mas_async.runtime.actor import Peer, PeerDead
from mas_async.wire.messages import PROTOCOL_VERSION, Welcome, decode, encode
from tests.support.paths import ROOT

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run one at a time (make test)


def _deployment(port: int, model: str = "") -> Deployment:
    return Deployment(
        f"tcp://127.0.0.1:{port}", {"vertical": 1, "horizontal": 2}, {"vertical": model, "horizontal": model}
    )


def test_the_router_names_the_peers_that_never_joined(tmp_path):
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["cluster.startup_timeout_s=0.5", "cluster.curve=false"])
    router = Router(config, _deployment(free_ports("127.0.0.1", 1)[0]), tmp_path)
    with pytest.raises(PeerDead, match=r"peers never joined within 0.5s: \['env_worker/0', 'env_worker/1', "):
        router.run()


def test_a_peer_names_a_router_that_went_silent():
    """A router that welcomes the peer and then says nothing: the peer stops after peer_timeout_s."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def welcome_then_silence() -> None:
        identity, *frames = sock.recv_multipart()
        assert decode(frames).pid > 0  # the Hello
        sock.send_multipart([identity, *encode(Welcome(PROTOCOL_VERSION))])

    answer = threading.Thread(target=welcome_then_silence, daemon=True)
    answer.start()
    peer = Peer("env_worker/0", f"tcp://127.0.0.1:{port}", heartbeat_s=0.1, peer_timeout_s=0.6, startup_timeout_s=5)
    try:
        with pytest.raises(PeerDead, match=r"the router has been silent for \d+s"):
            peer.run()
    finally:
        answer.join(5)
        sock.close(linger=0)
        ctx.term()


def test_a_generate_request_without_a_reply_names_the_request_and_policy(tmp_path):
    from mas_async.rollout.env_worker import EnvWorker, GenerateError
    from mas_async.tiny_model import materialise

    model = str(materialise("builtin:tiny-char", tmp_path / "models"))
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["rollout.request_timeout_s=0.3"])
    worker = EnvWorker(config, _deployment(1, model), 0)
    worker.send = lambda msg: None  # the request goes nowhere: no result ever comes

    async def ask() -> None:
        await worker.generate("vertical", np.array([1, 2, 3], dtype=np.int32), 2, greedy=False)

    with pytest.raises(GenerateError, match=r"generate request \d+ to policy 'vertical' timed out after 0.3s"):
        asyncio.run(ask())
    assert worker._pending == {}  # nothing left waiting


def _weight_sync_pair(timeout_s: float) -> tuple[Any, Any]:
    """A trainer's sender and one replica's receiver of a gloo weight group, in this process."""
    from mas_async.weights.sync import open_receiver, open_sender

    join = dict(policy="vertical", backend="gloo", host="127.0.0.1", port=free_ports("127.0.0.1", 1)[0], world_size=2)
    box: dict[str, Any] = {}
    opener = threading.Thread(target=lambda: box.update(sender=open_sender(**join, timeout_s=timeout_s)), daemon=True)
    opener.start()
    receiver = open_receiver(**join, rank=1, timeout_s=timeout_s)
    opener.join(30)
    return box["sender"], receiver


def test_a_weight_broadcast_nobody_receives_names_the_version_and_the_replicas():
    from mas_async.weights.group import WeightSyncError

    sender, _receiver = _weight_sync_pair(timeout_s=1.0)
    with pytest.raises(WeightSyncError) as error:
        sender.send(3, [("w", torch.ones(1000))])  # the replica never receives
    assert re.search(
        r"rank 0 of policy 'vertical'.s weight group \(gloo\): the header of v3 did not complete within 1 s, "
        r"waiting for its inference replicas \(ranks 1\.\.1\)",
        str(error.value),
    ), error.value


def test_a_replica_waiting_for_weights_that_never_come_names_its_trainer():
    from mas_async.weights.group import WeightSyncError

    _sender, receiver = _weight_sync_pair(timeout_s=1.0)
    with pytest.raises(WeightSyncError, match=r"rank 1 of policy 'vertical'.s weight group \(gloo\): the header of "
                       r"the next version did not complete within 1 s, waiting for its trainer \(rank 0\)"):  # fmt: skip
        receiver.receive()


def test_a_re_formed_generation_that_a_rank_never_joins_names_the_generation():
    from mas_async.weights.group import WeightGroupError, open_weight_group

    port = free_ports("127.0.0.1", 1)[0]
    with pytest.raises(WeightGroupError, match=r"rank 0 of policy 'vertical'.s weight group: generation 1 was not "
                       r"joined by all 2 ranks within 1s"):  # fmt: skip
        open_weight_group(
            policy="vertical", backend="gloo", host="127.0.0.1", port=port, rank=0, world_size=2, timeout_s=1.0,
            generation=1,
        )  # fmt: skip


def test_reaching_the_store_and_meeting_the_others_share_one_bound():
    """Rank 1 reaches rank 0's store only 1.2 s into its 2 s bound, and rank 0 never arrives: the join gives
    up 2 s after it began, not 2 s after it reached the store."""
    from mas_async.weights.group import WeightGroupError, open_weight_group
    from mas_async.weights.store import open_store

    port = free_ports("127.0.0.1", 1)[0]
    held = []
    late = threading.Timer(1.2, lambda: held.append(open_store("127.0.0.1", port, 2, is_master=True, timeout_s=5)))
    late.start()
    began = time.monotonic()
    with pytest.raises(WeightGroupError, match=r"rank 1 of policy 'vertical'.s weight group: generation 0 was not "
                       r"joined by all 2 ranks within 2s"):  # fmt: skip
        open_weight_group(
            policy="vertical", backend="gloo", host="127.0.0.1", port=port, rank=1, world_size=2, timeout_s=2.0
        )
    late.join()
    assert held and 1.9 < time.monotonic() - began < 2.8


def test_a_store_that_comes_up_late_is_reached_at_once():
    """torch's client sleeps between its tries; waiting for the listener first connects as soon as the store
    is up (~0.01 s later; without it 0.07-0.8 s, median 0.3)."""
    from mas_async.weights.store import open_store

    def come_up(port: int, up: list[tuple[Any, float]]) -> None:
        up.append((open_store("127.0.0.1", port, 2, is_master=True, timeout_s=10), time.monotonic()))

    lags = []
    for _ in range(5):
        port = free_ports("127.0.0.1", 1)[0]
        up: list[tuple[Any, float]] = []
        late = threading.Timer(0.6, come_up, args=(port, up))
        late.start()
        open_store("127.0.0.1", port, 2, is_master=False, timeout_s=5)
        lags.append(time.monotonic() - up[0][1])
        late.join()
    # The median (without the wait: ~0.3 s): one try slowed by a busy machine does not decide.
    assert sorted(lags)[2] < 0.15, lags


def test_a_failed_send_that_no_re_form_follows_names_the_wait():
    """A send that lost a replica waits for the router's order to re-form the group, at most the weight-sync
    bound; past it, a named error (the trainer stops, the run restarts from its checkpoint)."""
    from types import SimpleNamespace

    from mas_async.training.publisher import WeightPublisher
    from mas_async.weights.group import WeightGroupSpec, WeightSyncError
    from mas_async.weights.sender import WeightSender

    class LostReplica(WeightSender):
        def __init__(self) -> None:
            self.group = SimpleNamespace(retire=lambda: None, generation=0)

        def send(self, version, named_tensors):
            raise WeightSyncError("Connection closed by peer")

    spec = WeightGroupSpec("vertical", "gloo", "127.0.0.1", 1, world_size=2, timeout_s=0.5)
    publisher = WeightPublisher(spec, 1 << 20, lambda msg: None)
    publisher.sender, publisher.generation = LostReplica(), 0
    with pytest.raises(WeightSyncError, match=r"policy 'vertical': the send of v4 failed \(Connection closed by peer\) "
                       r"and the router ordered no re-formed weight group within trainer.weight_sync_timeout_s=0.5s"):  # fmt: skip
        asyncio.run(publisher.publish(lambda: (4, [])))


def test_the_weight_sync_bound_comes_from_the_config():
    from mas_async.weights.group import WeightGroupSpec

    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["trainer.weight_sync_timeout_s=7"])
    spec = WeightGroupSpec.of(config, _deployment(1), "vertical")
    assert spec.join_args(0)["timeout_s"] == spec.join_args(1)["timeout_s"] == 7.0


def test_a_backend_that_hangs_in_generate_stops_its_server_with_a_named_error(tmp_path):
    """The requests' callers give up at their deadline; the server waits request_timeout_s more, then stops
    (BackendHung) so that the launcher restarts the replica, and its update gate is not left held."""
    from mas_async.inference.server import BackendHung, InferenceServer
    from mas_async.tiny_model import materialise
    from mas_async.wire.messages import Generate

    class HungBackend:
        concurrent = False
        version = 0

        async def generate(self, requests):
            await asyncio.Event().wait()  # never returns

    model = str(materialise("builtin:tiny-char", tmp_path / "models"))
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["rollout.request_timeout_s=0.3"])
    server = InferenceServer(
        config, Deployment("tcp://127.0.0.1:1", {"vertical": 1}, {"vertical": model}), "vertical", 0
    )
    server.backend = HungBackend()
    request = Generate(1, "vertical", "env_worker/0", time.time() + 0.2, np.array([1, 2], np.int32), 1, 1, 1.0, 1.0,
                       False, [])  # fmt: skip

    async def serve() -> None:
        await server.gate.acquire_read()
        try:
            await server._serve([request])
        finally:
            assert await asyncio.wait_for(server.gate.acquire_write(), 1.0) is None  # the read side was released

    began = time.monotonic()
    with pytest.raises(BackendHung, match=r"inference/vertical/0: the backend's generate of 1 requests did not return"):
        asyncio.run(serve())
    assert time.monotonic() - began < 5.0


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_a_vllm_call_that_never_finishes_is_named():
    from mas_async.inference.backends.vllm import EngineTimeout, VLLMBackend

    backend = object.__new__(VLLMBackend)  # the engine loop alone: no engine is needed to hang a call
    backend._loop = asyncio.new_event_loop()
    backend._thread = threading.Thread(target=backend._loop.run_forever, daemon=True)
    backend._thread.start()
    try:
        with pytest.raises(EngineTimeout, match=r"vLLM did not finish loading weights v3 within 0.2 s$"):
            backend._call(asyncio.sleep(60), "loading weights v3", 0.2)
        backend.engine = type("DeadEngine", (), {"errored": True})()  # what vLLM's AsyncLLM says once its core died
        with pytest.raises(EngineTimeout, match=r"within 0.2 s \(its engine process has died\)"):
            backend._call(asyncio.sleep(60), "loading weights v3", 0.2)
    finally:
        backend._stop_loop()


def test_a_broadcast_that_completes_as_the_group_is_retired_is_a_success():
    """A work that is complete when its group is retired is a success (its own untimed wait says so), not
    an abandoned wait: a receive misread that way would be abandoned while the trainer counts it delivered.
    (That no timed wait is ever called: tests/unit/framework/test_nccl_wait.py.)"""
    from types import SimpleNamespace

    from mas_async.weights.group import WeightGroup

    class JustInTime:
        def __init__(self) -> None:
            self.waits: list[Any] = []

        def wait(self, timeout=None):
            self.waits.append(timeout)
            return True

        def is_completed(self) -> bool:
            return True

    work = JustInTime()
    group = SimpleNamespace(
        retired=lambda: True, rank=1, policy="vertical", generation=0, timeout_s=5.0, backend="gloo"
    )
    WeightGroup._wait(group, work, "bucket 1 of 1 of v1")  # type: ignore[arg-type]
    assert work.waits == [None]
