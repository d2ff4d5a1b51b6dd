"""The actor runtime against a hand-driven router socket: handshake, heartbeats during a blocking
call, malformed input, clean shutdown, and a silent router detected as a named error."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import zmq

from mas_async.deployment import free_ports
from mas_async.runtime.actor import PARENT_PID_ENV
from mas_async.wire.messages import PROTOCOL_VERSION, Heartbeat, Hello, Shutdown, Welcome, decode, encode
from tests.support.paths import ROOT


def _start_peer(endpoint: str, peer_timeout_s: float, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.runtime_peer", endpoint, str(peer_timeout_s)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
    )  # fmt: skip


def _router(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    endpoint = f"tcp://127.0.0.1:{free_ports('127.0.0.1', 1)[0]}"
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    return sock, endpoint


def _recv(sock: zmq.Socket, timeout_s: float = 30.0) -> tuple[bytes, object]:
    assert sock.poll(timeout_s * 1000), "no message from the peer"
    identity, *frames = sock.recv_multipart()
    return identity, decode(frames)


def test_handshake_heartbeats_during_blocking_call_and_clean_shutdown():
    ctx = zmq.Context()
    sock, endpoint = _router(ctx)
    proc = _start_peer(endpoint, peer_timeout_s=30)
    try:
        identity, hello = _recv(sock)
        assert isinstance(hello, Hello) and identity == b"env_worker/7"
        assert (hello.role, hello.capacity, hello.protocol, hello.pid) == (
            "env_worker",
            3,
            PROTOCOL_VERSION,
            proc.pid,
        )
        sock.send_multipart([identity, *encode(Welcome(PROTOCOL_VERSION))])
        # While main() sits in a 3 s blocking call, the loop keeps sending heartbeats every 0.2 s.
        beats, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 2.0:
            _, msg = _recv(sock)
            beats += isinstance(msg, Heartbeat)
        assert beats >= 5
        sock.send_multipart([identity, b"\x63", b"junk", b"junk"])  # unknown kind
        sock.send_multipart([identity, b"\x01"])  # too few frames
        sock.send_multipart([identity, *encode(Shutdown("test over", False))])
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, out
        assert "malformed=2" in out
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close(linger=0)
        ctx.term()


def test_a_silent_router_is_a_named_error_not_a_hang():
    ctx = zmq.Context()
    sock, endpoint = _router(ctx)
    proc = _start_peer(endpoint, peer_timeout_s=1.5)
    try:
        identity, _ = _recv(sock)
        sock.send_multipart([identity, *encode(Welcome(PROTOCOL_VERSION))])
        out, _ = proc.communicate(timeout=30)  # we never answer a heartbeat
        assert proc.returncode == 1
        assert "the router has been silent" in out
    finally:
        if proc.poll() is None:
            proc.kill()
        sock.close(linger=0)
        ctx.term()


def test_a_process_whose_starter_is_gone_stops_while_it_still_sets_up():
    # Its starter (an engine's actor, say) died before the process got going: it must not take its new
    # parent for the one to watch, nor wait out its startup timeout for a router that will never answer.
    gone = subprocess.Popen(["true"])
    gone.wait()
    endpoint = f"tcp://127.0.0.1:{free_ports('127.0.0.1', 1)[0]}"  # nobody listens: setup waits for Welcome
    proc = _start_peer(endpoint, peer_timeout_s=30, env={PARENT_PID_ENV: str(gone.pid)})
    try:
        out, _ = proc.communicate(timeout=20)
        assert f"parent process {gone.pid} is gone; shutting down" in out
    finally:
        if proc.poll() is None:
            proc.kill()
