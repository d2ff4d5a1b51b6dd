"""Every wait has a bound and a named error that says who was waited for (docs/faults.md): the router waiting
for its peers to join, a peer waiting for a silent router, an env worker waiting for a generate result.
(The weight group's join: tests/integration/test_weight_sync.py; the step barrier: test_faults.py.)"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import zmq

from mas_async.config import load_config
from mas_async.deployment import Deployment, free_ports
from mas_async.router.hub import Router
from mas_async.runtime.actor import Peer, PeerDead
from mas_async.wire.messages import PROTOCOL_VERSION, Welcome, decode, encode
from tests.support.paths import ROOT


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
