"""CURVE security for the ZeroMQ sockets of a run: its keys, and the settings of each end.

Every message of a run travels between the router's ROUTER socket (the only listener) and the DEALER of
a peer (env worker, inference server, trainer). With `cluster.curve` on (the default, loopback included),
the launcher makes the run's keys once (`prepare_keys`; a resumed run reuses those of its directory):

    RUN_DIR/keys/           mode 0700, every file in it 0600
      server.key            the router's public key: every peer needs it to reach the router
      server.key_secret     the router's key pair
      client.key            the run's client public key: the only one the router allows
      client.key_secret     the run's client key pair, held by every peer

CURVE encrypts every frame and authenticates both ends: a peer must know the router's public key and hold
the run's client key pair. The key check itself is ZAP (ZeroMQ's authentication protocol): a handler
bound in the router's context answers each handshake. Without one, libzmq would accept any client that
knows the router's public key, so the router starts `RunAuthenticator` before it binds. Refused
handshakes are counted and logged by `mas_async.runtime.handshakes`.
"""

from __future__ import annotations

import hmac
import logging
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio
from zmq.auth import Authenticator, create_certificates, load_certificate

if TYPE_CHECKING:
    from mas_async.config import Config

log = logging.getLogger("mas_async.curve")

KEYS_DIR = "keys"
"""The folder of the run's keys, under the run directory."""
SERVER = "server"
CLIENT = "client"


class CurveKeyError(RuntimeError):
    """A run's CURVE key file is missing or unreadable."""


def prepare_keys(config: Config, run_dir: Path) -> str | None:
    """The run's keys folder (made now, or reused from an earlier start of the same run), or None when
    `cluster.curve` is off. This is what `Deployment.keys_dir` records."""
    if not config.cluster.curve:
        return None
    return str(generate_keys(run_dir / KEYS_DIR))


def generate_keys(keys_dir: Path) -> Path:
    """Make the server and client key pairs in `keys_dir` unless they are there already; either way the
    folder ends up mode 0700 and its files 0600."""
    # Mode 0700 before any secret is written: mkdir's mode is cut by the umask, and an old folder keeps its own.
    keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    keys_dir.chmod(0o700)
    for name in (SERVER, CLIENT):
        public, secret = keys_dir / f"{name}.key", keys_dir / f"{name}.key_secret"
        if not (public.is_file() and secret.is_file()):
            create_certificates(keys_dir, name)
        secret.chmod(0o600)
        public.chmod(0o600)
    return keys_dir


def _load(keys_dir: Path, name: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    path = keys_dir / (f"{name}.key_secret" if secret else f"{name}.key")
    try:
        public, secret_key = load_certificate(path)
    except (OSError, ValueError) as e:
        raise CurveKeyError(
            f"cannot read the run's CURVE key {path}: {e}. The launcher writes the keys into RUN_DIR/{KEYS_DIR} "
            "when cluster.curve is true (the default); a process of the run needs them there"
        ) from None
    if secret and secret_key is None:
        raise CurveKeyError(f"{path} holds no secret key: the run's keys are damaged; start a new run directory")
    return public, secret_key


def secure_server(sock: zmq.Socket, keys_dir: str | Path) -> None:
    """Make `sock` a CURVE server with the run's server key pair (before it binds). Which clients it
    accepts is decided by the context's `RunAuthenticator`."""
    public, secret = _load(Path(keys_dir), SERVER, secret=True)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, keys_dir: str | Path) -> None:
    """Make `sock` a CURVE client with the run's client key pair and the router's public key (before it
    connects)."""
    keys_dir = Path(keys_dir)
    public, secret = _load(keys_dir, CLIENT, secret=True)
    server_public, _ = _load(keys_dir, SERVER, secret=False)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


class RunAuthenticator(Authenticator):
    """The ZAP handler of one context: allows only the run's client public key.

    pyzmq's `zmq.auth.Authenticator` does the ZAP protocol; `serve()` answers its requests on the owner's
    event loop and is meant to run as a supervised task (pyzmq's `AsyncioAuthenticator` runs the same
    loop in a task nobody watches: if it died, every later handshake would hang unanswered). `start()`
    binds the ZAP endpoint at once, so a handshake that arrives before `serve()` runs waits for it rather
    than passing unchecked.

    Every refused key is remembered with its peer's address (`refused`, newest last) for the log line of
    the router's refusal counter.
    """

    def __init__(self, ctx: zmq.Context, keys_dir: str | Path) -> None:
        super().__init__(ctx, log=logging.getLogger("mas_async.curve.zap"))
        client_public, _ = _load(Path(keys_dir), CLIENT, secret=False)
        self.client_key = client_public
        self.refused: deque[tuple[str, str]] = deque(maxlen=1024)
        """(peer address, its z85 public key) of each refused key."""
        self._address = ""
        self.configure_curve_callback("*", self)

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # The key callback is not told the peer's address; the request is (frame 3), and requests are
        # handled one at a time.
        self._address = msg[3].decode(errors="replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def callback(self, domain: str, key: bytes) -> bool:
        """zmq.auth's CURVE check: `key` is the client's z85 public key."""
        if hmac.compare_digest(key, self.client_key):
            return True
        self.refused.append((self._address, key.decode(errors="replace")))
        return False

    async def serve(self) -> None:
        """Answer ZAP requests until cancelled."""
        poller = zmq.asyncio.Poller()
        poller.register(self.zap_socket, zmq.POLLIN)
        try:
            while True:
                await poller.poll()
                while self.zap_socket.poll(0):
                    await self.handle_zap_message(self.zap_socket.recv_multipart())
        finally:
            poller.unregister(self.zap_socket)
