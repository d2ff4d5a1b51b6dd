"""Per-episode sessions of the gateway: who is calling, which agent's turn a call is, and what it returned.

The env worker opens one `Session` per episode of a `workflow.program` and gives the program's clients
its key (the API key, sent as `Authorization: Bearer <key>`), so every call is attributed to (episode,
agent, turn) by the key and the `model` field. An agent's turns are numbered by its calls in the episode:
the first call of agent a is turn 0 of a, whatever the other agents did. A call reserves its turn when
it arrives, so concurrent calls of one agent get distinct turns. Every returned choice is a `Call` (under
tree sampling every candidate, with its score, the returned one `chosen`); when the program returns, the
episode credits the calls with its rewards and records them as samples (`episode.py`). A closed session's
key is remembered (up to `ENDED_KEYS`), so a late call is told that its episode ended rather than that its
key is unknown. On a gateway served outside the run the key comes after the run's token in the API key
(`access.py`).
"""

from __future__ import annotations

import contextvars
import secrets
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mas_async.gateway.errors import GatewayError
from mas_async.gateway.transcript import Transcript

if TYPE_CHECKING:
    import numpy as np

    from mas_async.gateway.tree import Score
    from mas_async.wire.samples import Completion

ENDED_KEYS = 65536
"""Keys of closed sessions remembered to answer "episode ended" (older ones get "unknown key")."""


@dataclass(slots=True)
class Call:
    """One choice the gateway returned: agent, turn, the ids the model saw and the completion it sampled."""

    agent: str
    policy: str
    turn: int
    index: int
    prompt_ids: np.ndarray
    completion: Completion
    text: str
    prompt_source: str
    score: float | None = None
    """Under tree sampling, the scorer's score of this candidate (`tree.py`); None otherwise."""
    chosen: bool = True
    """Whether the program was given this choice (under tree sampling: the best of the K candidates only)."""


@dataclass
class Session:
    """One episode's calls through the gateway."""

    key: str
    episode_id: str
    problem_id: str
    mode: str
    policy_of: dict[str, str]
    tokenizers: dict[str, Any]
    template_kwargs: dict[str, dict[str, Any]]
    max_calls: int
    calls: list[Call] = field(default_factory=list)
    requests: int = 0
    """Requests admitted so far (each may return n choices)."""
    turns: Counter[str] = field(default_factory=Counter)
    """agent -> turns taken (calls admitted)."""
    sources: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(agent, prompt source) -> calls: fresh, reused, edited (a prefix mismatch), retokenized."""
    in_process: Counter[str] = field(default_factory=Counter)
    """agent -> calls answered to an in-process client, without HTTP (`in_process.py`)."""
    closed: bool = False
    score: Score | None = None
    """The scorer bound to the episode's task in a tree-sampled training episode (`tree.py`): each call is
    then K candidates, the best one returned; None: each call samples the n choices it asks."""
    failure: str | None = None
    """Why the episode failed inside the gateway (its scorer failed): its later calls are refused, and the
    episode raises it when the program returns (`GatewayEpisode.play`)."""
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Responses API: response id -> the conversation a request with that `previous_response_id` continues
    (its input, then its output; `responses_api.py`), for each response stored (`store` not false)."""
    context: contextvars.Context = field(default_factory=contextvars.copy_context)
    """The context variables of the episode's task, where the session is opened (its iteration, its place,
    a bench's record of its id): the generate request of each call runs in a copy of them, as part of the
    episode, though the HTTP handler's own task is the server's."""
    _transcripts: dict[str, Transcript] = field(default_factory=dict)

    def admit(self, agent: str) -> int:
        """Take the next turn of `agent`, or refuse a call over the episode's limit or of a failed episode."""
        if self.failure is not None:
            raise GatewayError(500, f"episode {self.episode_id} has failed: {self.failure}", type="server_error")
        if self.requests >= self.max_calls:
            raise GatewayError(
                400,
                f"episode {self.episode_id} made its {self.max_calls} calls (gateway.max_calls_per_episode)",
                code="episode_call_limit",
            )
        self.requests += 1
        turn = self.turns[agent]
        self.turns[agent] += 1
        return turn

    def release(self, agent: str, turn: int, source: str) -> None:
        """Give back `turn` of `agent`, taken by a call that sampled nothing (the inference side refused or
        failed it), so that the agent's next call is that turn again and is grouped with the other
        episodes' calls of it; a turn that a later call of the agent already follows stays taken."""
        self.sources[(agent, source)] -= 1
        if self.turns[agent] == turn + 1:
            self.turns[agent] = turn

    def transcript(self, agent: str) -> Transcript:
        if agent not in self._transcripts:
            policy = self.policy_of[agent]
            self._transcripts[agent] = Transcript(self.tokenizers[policy], self.template_kwargs.get(policy))
        return self._transcripts[agent]


class Sessions:
    """The open sessions of one gateway, by key, and the keys of recently closed ones."""

    def __init__(self) -> None:
        self.open: dict[str, Session] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # key -> episode id

    def add(self, **fields: Any) -> Session:
        session = Session(key=f"mas-{secrets.token_urlsafe(24)}", **fields)
        self.open[session.key] = session
        return session

    def close(self, session: Session) -> None:
        session.closed = True
        if self.open.pop(session.key, None) is not None:
            self._ended[session.key] = session.episode_id
            while len(self._ended) > ENDED_KEYS:
                self._ended.popitem(last=False)

    def get(self, key: str | None, *, authenticated: bool = False) -> Session:
        """The open session of `key`, or a 409 for an ended episode. A missing or unknown key is a 401 when
        the key itself is the credential (loopback); after the run's token was checked (`authenticated`, an
        external gateway: `access.py`) the caller is the run's, and it is a 404 naming no episode."""
        if not key:
            if authenticated:
                raise GatewayError(
                    404,
                    "the API key holds this run's token but no episode key: send '<run token>.<episode key>' "
                    "(Task.api_key)",
                    code="episode_not_found",
                )
            raise GatewayError(
                401,
                "no API key: send the episode's key as 'Authorization: Bearer <key>' (the clients a workflow "
                "program is given carry it)",
                code="invalid_api_key",
            )
        session = self.open.get(key)
        if session is not None:
            return session
        if key in self._ended:
            raise GatewayError(
                409,
                f"episode {self._ended[key]} has ended: its clients cannot make calls any more",
                code="episode_ended",
            )
        if authenticated:
            raise GatewayError(
                404,
                "the episode key names no open episode of this env worker (each env worker's gateway serves the "
                "episodes it runs)",
                code="episode_not_found",
            )
        raise GatewayError(401, "unknown API key: it names no episode of this env worker", code="invalid_api_key")
