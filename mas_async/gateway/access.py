"""Who may call a gateway: the episode's key on loopback, the run's token with it when served outside the run.

A gateway on loopback (`gateway.external: false`, the default) is called by the workflow programs of its
own env worker only, and a request's API key is its episode's session key (`session.py`): the key both
names the episode and proves that the caller was given it.

With `gateway.external: true` the gateway binds the address of its worker's node, so that an agent
service that is not an env worker (another process, another machine) can make an episode's calls. Every
request must then also carry the run's **token**, a random secret minted by the launcher at each start of
the run and written to RUN_DIR/keys/gateway_token (folder 0700, file 0600; deployment.json names it):

    Authorization: Bearer <run token>.<episode key>

The openai package sends exactly that when `api_key` is "<run token>.<episode key>"; the episode's
clients and `Task.api_key` carry it. The token is compared in constant time (`hmac.compare_digest`), so
how long a refusal takes says nothing about how much of a guess was right. A request without it, or with
another, is refused with a 401 in OpenAI's shape before any route runs, counted (`Access.refused`, reported
as `gateway/refused_auth`) and logged at a bounded rate (`LogLimit`: a flood of refusals writes a few
lines); it never reaches a session. A request with the token whose episode key names no open episode of
this worker is a caller's mistake, not an intrusion: a 404 (`episode_not_found`), or a 409 for an episode
that ended.

Unlike the CURVE secrets (`mas_async.runtime.curve`), which never touch the disk, the token is written to
the run folder: it is the one secret meant for processes outside the run (an agent service, an operator's
client), and every env worker, on any node, reads it there. Whoever can read the run folder can call the
gateways, as whoever can read it can join the run.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn
from urllib.parse import urlsplit

from mas_async.gateway.errors import GatewayError
from mas_async.runtime.curve import KEYS_DIR
from mas_async.runtime.log_limit import LogLimit, printable

if TYPE_CHECKING:
    from mas_async.config import Config
    from mas_async.deployment import Deployment

log = logging.getLogger("mas_async.gateway.access")

TOKEN_FILE = "gateway_token"
"""The run token's file, in the run's keys folder (RUN_DIR/keys/gateway_token)."""
SEPARATOR = "."
"""Between the run token and the episode key in an API key (neither holds one: both are URL-safe base64)."""


class TokenError(RuntimeError):
    """The run's gateway token is missing or unreadable."""


def mint_token(run_dir: Path) -> Path:
    """A new run token in RUN_DIR/keys/gateway_token (folder 0700, file 0600; the token of an earlier start
    is replaced); returns the file."""
    keys_dir = run_dir / KEYS_DIR
    # Mode 0700 before anything is written: mkdir's mode is cut by the umask, and an old folder keeps its own.
    keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    keys_dir.chmod(0o700)
    path = keys_dir / TOKEN_FILE
    tmp = keys_dir / f"{TOKEN_FILE}.tmp"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    os.replace(tmp, path)
    return path


def read_token(path: str | Path) -> str:
    """The run token in `path` (a TokenError naming the file when it cannot be read)."""
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise TokenError(
            f"cannot read the run's gateway token {path}: {e}. The launcher writes it into RUN_DIR/{KEYS_DIR} when "
            "gateway.external is true; an env worker of the run needs it there"
        ) from None
    if not token or SEPARATOR in token:
        raise TokenError(f"{path} does not hold a gateway token (it was not written by the launcher)")
    return token


def listener(config: Config, deployment: Deployment, worker: str, index: int) -> tuple[str, int, Access]:
    """Where env worker `worker` (number `index`) serves its gateway, and who may call it: with
    `gateway.external`, its node's address and the port that deployment.json records, and the run's token;
    else `gateway.host`, `gateway.port` + index (0: a free one) and the episode keys alone."""
    gateway = config.gateway
    if not gateway.external:
        return gateway.host, gateway.port + index if gateway.port else 0, Access()
    url = deployment.gateways.get(worker)
    if url is None or deployment.gateway_token is None:
        raise TokenError(
            f"gateway.external is true but deployment.json names no gateway or token for {worker}: the launcher "
            "records them (a deployment built by hand needs `gateways` and `gateway_token`)"
        )
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None, url
    return parts.hostname, parts.port, Access(read_token(deployment.gateway_token))


def bearer(header: str) -> str | None:
    """The key of an `Authorization: Bearer <key>` header (the scheme in any case), None without one."""
    scheme, _, key = header.partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


class Access:
    """A gateway's rule for who may call it: `token` None on loopback (the episode key alone), the run's
    token when external (module docstring)."""

    def __init__(self, token: str | None = None) -> None:
        if token is not None and (not token or SEPARATOR in token):
            raise TokenError("a gateway token is a non-empty string without a '.'")
        self._token = token.encode() if token is not None else None
        self.refused = 0
        """Requests refused so far for a missing or wrong run token (external only)."""
        self._reported = 0
        self._limit = LogLimit()

    @property
    def external(self) -> bool:
        return self._token is not None

    def api_key(self, episode_key: str) -> str:
        """The API key of an episode's clients: its key, after the run token when external."""
        return episode_key if self._token is None else f"{self._token.decode()}{SEPARATOR}{episode_key}"

    def admit(self, authorization: str, peer: str | None) -> None:
        """Refuse (401, counted, logged at a bounded rate) a request to an external gateway that does not
        carry the run token; on loopback every request passes here (its session key is checked later)."""
        if self._token is None:
            return
        key = bearer(authorization)
        if key is None:
            self._refuse(
                "no API key", peer, "no API key: send 'Authorization: Bearer <run token>.<episode key>' (Task.api_key)"
            )
        token = key.partition(SEPARATOR)[0].encode(errors="surrogateescape")  # (how aiohttp decodes bytes)
        if not hmac.compare_digest(token, self._token):
            self._refuse(
                "not the run's token",
                peer,
                "invalid API key: it does not start with this run's gateway token (RUN_DIR/keys/gateway_token), "
                "then '.' and the episode's key",
            )

    def episode_key(self, authorization: str) -> str | None:
        """The episode key of an admitted request's header (None when it names none)."""
        key = bearer(authorization)
        if key is None or self._token is None:
            return key
        return key.partition(SEPARATOR)[2] or None

    def take_refused(self) -> int:
        """Refusals since the last call (each episode's summary carries those since the previous episode's)."""
        fresh, self._reported = self.refused - self._reported, self.refused
        return fresh

    def _refuse(self, why: str, peer: str | None, message: str) -> NoReturn:
        self.refused += 1
        if n := self._limit.due(why):
            log.warning(
                "gateway: refused a request from %s: %s (%d such so far, %d refused in all)",
                printable(peer or "?"), why, n, self.refused,
            )  # fmt: skip
        raise GatewayError(401, message, code="invalid_api_key")
