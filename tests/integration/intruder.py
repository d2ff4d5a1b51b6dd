"""A client without the run's key: `python -m tests.integration.intruder ENDPOINT SERVER_KEY SECONDS`.

It sends a Hello to the run's router twice, once over a plain socket and once over CURVE with the router's
public key (which an attacker may know) but a key pair of its own, then listens for SECONDS. It prints
how many replies it got ("replies=N"), which must be 0."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import zmq
from zmq.auth import create_certificates, load_certificate

from mas_async.wire.messages import PROTOCOL_VERSION, Hello, encode


def main(endpoint: str, server_key: str, seconds: float) -> int:
    server_public, _ = load_certificate(server_key)
    ctx = zmq.Context()
    ctx.linger = 0
    socks = []
    with tempfile.TemporaryDirectory() as tmp:
        public, secret = load_certificate(create_certificates(Path(tmp), "intruder")[1])
    for curve in (False, True):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"env_worker/intruder-{int(curve)}".encode())
        if curve:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, public, secret
        sock.connect(endpoint)
        sock.send_multipart(encode(Hello("env_worker", "env_worker/intruder", "", 1, PROTOCOL_VERSION, 1)))
        socks.append(sock)
    replies, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        replies += sum(1 for sock in socks if sock.poll(100))
    print(f"replies={replies}", flush=True)
    ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
