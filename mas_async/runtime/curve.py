"""CURVE security for the ZeroMQ sockets of a run: one key pair per process, and one identity per key.

Every message of a run travels between the router's ROUTER socket and the DEALER of a peer (env worker,
inference server, trainer); with `cluster.leases` an env worker's Generates also travel between its DEALER
and an inference replica's own ROUTER socket (`mas_async.inference.direct`). With `cluster.curve` on (the
default, loopback included), the launcher makes a key pair for the router and one for every process of the
deployment each time it starts the run (`prepare_keys`), and writes only the public keys:

    RUN_DIR/keys/           mode 0700
      public.json           mode 0600: {"router": z85 public key, "peers": {process name: z85 public key}}

Each secret key is given to its own process alone, in its environment (`MAS_ASYNC_CURVE_SECRET`, which
the process removes from its environment at start, so nothing it starts inherits it); a replacement of a
lost process gets the same one. No secret key is ever written to the run folder, which every node of a
run shares: a node holds the secrets of the processes it runs and no other.

CURVE encrypts every frame and authenticates both ends. The key check itself is ZAP (ZeroMQ's
authentication protocol): a handler bound in the router's context answers each handshake. Without one,
libzmq would accept any client that knows the router's public key, so the router starts
`RunAuthenticator` before it binds. It admits only the peers' public keys, and names each connection by
the process its key was issued to: libzmq attaches that name to every message of the connection as its
`User-Id` property, and the router takes it, not the socket identity the sender chose, as the sender
(a Hello whose peer id is another, and anything sent over another connection than the one a name
joined with, is refused and counted). Refused handshakes are counted and logged by
`mas_async.runtime.handshakes`. A replica's direct socket is a CURVE server with the replica's own key
pair, and its context's `RunAuthenticator` admits the env workers' keys alone, each as its process.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio
from zmq.auth import Authenticator

if TYPE_CHECKING:
    from mas_async.config import Config

log = logging.getLogger("mas_async.curve")

KEYS_DIR = "keys"
"""The folder of the run's public keys, under the run directory."""
PUBLIC_FILE = "public.json"
ROUTER = "router"
SECRET_ENV = "MAS_ASYNC_CURVE_SECRET"
"""Where a process finds its own secret key (z85 text), set by the launcher for that process alone."""

_issued: dict[str, dict[str, str]] = {}
"""keys folder -> process name -> secret key, of the keys this launcher process made (never on disk)."""
_own: str | None = None


class CurveKeyError(RuntimeError):
    """A run's CURVE key is missing or unreadable."""


def prepare_keys(config: Config, run_dir: Path, names: list[str]) -> str | None:
    """Make the keys of this start of the run (the router's and one pair per process of `names`): the keys
    folder, or None when `cluster.curve` is off. This is what `Deployment.keys_dir` records; the secret of
    each process is `issued_secret(keys_dir, name)`, in this launcher process only."""
    if not config.cluster.curve:
        return None
    keys_dir = run_dir / KEYS_DIR
    _issued[str(keys_dir)] = generate_keys(keys_dir, names)
    return str(keys_dir)


def generate_keys(keys_dir: Path, names: list[str]) -> dict[str, str]:
    """A key pair for the router and for each process of `names`: the public keys are written to
    keys_dir/public.json (folder 0700, file 0600; the file of an earlier start is replaced), the secret keys
    returned, process name -> z85 text ("router" included)."""
    # Mode 0700 before anything is written: mkdir's mode is cut by the umask, and an old folder keeps its own.
    keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    keys_dir.chmod(0o700)
    pairs = {name: zmq.curve_keypair() for name in dict.fromkeys([ROUTER, *names])}
    public = {"router": pairs[ROUTER][0].decode(), "peers": {n: pairs[n][0].decode() for n in pairs if n != ROUTER}}
    tmp = keys_dir / f"{PUBLIC_FILE}.tmp"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(public, f, indent=2)
    os.replace(tmp, keys_dir / PUBLIC_FILE)
    return {name: secret.decode() for name, (_, secret) in pairs.items()}


def issued_secret(keys_dir: str | Path, name: str) -> str:
    """The secret key made for process `name` by `prepare_keys` in this launcher process."""
    secrets = _issued.get(str(keys_dir))
    if secrets is None or name not in secrets:
        raise CurveKeyError(f"no CURVE key was made for {name!r} in {keys_dir} by this launcher process")
    return secrets[name]


def own_secret() -> str:
    """This process's secret key, from `MAS_ASYNC_CURVE_SECRET`, which is removed from the environment the
    first time (so no process this one starts, a sandbox or an engine's worker, inherits it)."""
    global _own
    if _own is None:
        secret = os.environ.pop(SECRET_ENV, "")
        if not secret:
            raise CurveKeyError(
                f"this process was given no CURVE secret key ({SECRET_ENV} is not set): the launcher gives each "
                "process of a run its own when cluster.curve is true (the default)"
            )
        _own = secret
    return _own


def public_keys(keys_dir: str | Path) -> dict:
    """The run's public keys: {"router": z85, "peers": {process name: z85}}."""
    path = Path(keys_dir) / PUBLIC_FILE
    try:
        keys = json.loads(path.read_text())
        if not isinstance(keys.get("router"), str) or not isinstance(keys.get("peers"), dict):
            raise ValueError("it does not hold a router key and the peers' keys")
    except (OSError, ValueError) as e:
        raise CurveKeyError(
            f"cannot read the run's CURVE public keys {path}: {e}. The launcher writes them into RUN_DIR/{KEYS_DIR} "
            "when cluster.curve is true (the default); a process of the run needs them there"
        ) from None
    return keys


def secure_server(sock: zmq.Socket, keys_dir: str | Path, secret: str | None = None) -> None:
    """Make `sock` a CURVE server with the key pair `secret` (the router's; else this process's own: an
    inference replica's direct socket, `cluster.leases`) before it binds. Which clients it accepts is
    decided by the context's `RunAuthenticator`."""
    secret = secret or own_secret()
    sock.curve_secretkey = secret.encode()
    sock.curve_publickey = zmq.curve_public(secret.encode())
    sock.curve_server = True


def secure_client(sock: zmq.Socket, keys_dir: str | Path, secret: str | None = None, server: str = ROUTER) -> None:
    """Make `sock` a CURVE client with the key pair `secret` (else this process's own) that connects to
    `server`: the router, or a process of the run by name (an inference replica's direct socket), whose
    public key it then requires of the other end (before it connects)."""
    secret = secret or own_secret()
    keys = public_keys(keys_dir)
    server_key = keys["router"] if server == ROUTER else keys["peers"].get(server)
    if not isinstance(server_key, str):
        raise CurveKeyError(f"{Path(keys_dir) / PUBLIC_FILE} holds no public key of {server!r}")
    sock.curve_secretkey = secret.encode()
    sock.curve_publickey = zmq.curve_public(secret.encode())
    sock.curve_serverkey = server_key.encode()


class RunAuthenticator(Authenticator):
    """The ZAP handler of one context: admits the public key of each process of the run, as that process.

    pyzmq's `zmq.auth.Authenticator` does the ZAP protocol; `serve()` answers its requests on the owner's
    event loop and is meant to run as a supervised task (pyzmq's `AsyncioAuthenticator` runs the same
    loop in a task nobody watches: if it died, every later handshake would hang unanswered). `start()`
    binds the ZAP endpoint at once, so a handshake that arrives before `serve()` runs waits for it rather
    than passing unchecked. Its answer names the process (`curve_user_id`): the User-Id of every message
    of the connection.

    `roles` narrows who is admitted to the processes of those roles (an inference replica's direct socket
    admits the env workers alone); None admits every process of the run (the router).

    Every refused key is remembered with its peer's address (`refused`, newest last) for the log line of
    the refusal counter.
    """

    def __init__(self, ctx: zmq.Context, keys_dir: str | Path, roles: tuple[str, ...] | None = None) -> None:
        super().__init__(ctx, log=logging.getLogger("mas_async.curve.zap"))
        self.names = {
            key.encode(): name
            for name, key in public_keys(keys_dir)["peers"].items()
            if roles is None or name.split("/", 1)[0] in roles
        }
        """z85 public key -> the one process name it may act as."""
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
        if key in self.names:  # (public keys: nothing to learn from how long the look-up takes)
            return True
        self.refused.append((self._address, key.decode(errors="replace")))
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        """The User-Id of an admitted connection: the process its key was issued to (called only after
        `callback` admitted the key; the key comes raw here, z85 there)."""
        return self.names[zmq.utils.z85.encode(client_public_key)]

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
