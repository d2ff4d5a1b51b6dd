"""A client without a key of the run: `python -m tests.integration.intruder ENDPOINT KEYS_DIR SECONDS`.

It sends a Hello to the run's router twice, once over a plain socket and once over CURVE with the router's
public key (which an attacker may know) but a key pair of its own, then listens for SECONDS. It prints
how many replies it got ("replies=N"), which must be 0."""

from __future__ import annotations

import sys
import time

import zmq

from mas_async.runtime.curve import public_keys
from mas_async.wire.messages import PROTOCOL_VERSION, Hello, encode


def main(endpoint: str, keys_dir: str, seconds: float) -> int:
    server_public = public_keys(keys_dir)["router"].encode()
    ctx = zmq.Context()
    ctx.linger = 0
    socks = []
    public, secret = zmq.curve_keypair()
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
