"""Every wire message of mas-async, in one module.

Each message is a small dataclass whose first `HEADER` fields form the header frame and the rest the
payload frame: `[kind (1 byte)] [header (msgpack list)] [payload (msgpack list)]`. The router dispatches
on the kind byte and reads only the header, through a named view (`peek` returns e.g.
`GroupsHeader(policy, iteration, episode_id, attempt, n_samples, n_tokens)`), never by position; payloads (token
ids, samples) are forwarded as opaque bytes.
Kinds are small ints, fields are only ever appended (a peer with another `PROTOCOL_VERSION` is refused
at Hello). Arrays are numpy arrays packed as binary ext values by `codec`.

Shapes: P = prompt tokens, T = completion tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import typing
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar

import numpy as np

from mas_async.wire.codec import CodecError, pack, unpack, unpack_header
from mas_async.wire.samples import Completion, Sample

PROTOCOL_VERSION = 9


class Kind(IntEnum):
    HELLO = 1
    WELCOME = 2
    HEARTBEAT = 3
    SHUTDOWN = 4
    RUN_EPISODE = 10
    EPISODE_DONE = 11
    GROUPS = 12
    GROUPS_RECEIVED = 13
    GENERATE = 20
    GENERATE_RESULT = 21
    LEASE = 22
    TRAINERS = 23
    TRAIN_STEP = 30
    TRAINED = 31
    UPDATE_WEIGHTS = 32
    WEIGHTS_LOADED = 33
    REFORM_WEIGHT_GROUP = 34
    ACCEPTED = 35
    WITHDRAWN = 36


@dataclass(slots=True)
class Message:
    KIND: ClassVar[Kind]
    HEADER: ClassVar[int]
    """Number of leading fields that form the header frame."""


# ---- control ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Hello(Message):
    """peer -> router, first message of every peer: who it is and what it can take."""

    KIND = Kind.HELLO
    HEADER = 6
    role: str  # "env_worker" | "inference" | "trainer"
    peer_id: str  # the socket identity, e.g. "inference/vertical/0"
    policy: str  # "" for roles that serve no single policy
    capacity: int  # concurrent episodes (env worker) or sequences per batch (inference)
    protocol: int
    pid: int
    died_at: float = 0.0  # a restarted process: unix time its predecessor was found dead (0: first start)
    endpoint: str = ""  # an inference server's or trainer's direct endpoint, "tcp://<address>:<port>" (cluster.leases)
    # (env workers send it Generates there, `Lease`); "" otherwise


@dataclass(slots=True)
class Welcome(Message):
    """router -> peer: the Hello was accepted."""

    KIND = Kind.WELCOME
    HEADER = 1
    protocol: int


@dataclass(slots=True)
class Heartbeat(Message):
    """peer <-> router, every cluster.heartbeat_s; silence past peer_timeout_s means death."""

    KIND = Kind.HEARTBEAT
    HEADER = 1
    sent_at: float


@dataclass(slots=True)
class Shutdown(Message):
    """router -> peers: stop now (run finished, or failed with `reason`)."""

    KIND = Kind.SHUTDOWN
    HEADER = 2
    reason: str
    failed: bool


# ---- rollout ------------------------------------------------------------------------------------


@dataclass(slots=True)
class RunEpisode(Message):
    """router -> env worker: run one episode of `problem` at weight version `version`."""

    KIND = Kind.RUN_EPISODE
    HEADER = 4
    episode_id: str  # unique per (iteration, problem): "<mode><iteration>-<index>"
    iteration: int
    mode: str  # "train" (tree sampling, samples recorded) | "eval" (one greedy sample, none recorded)
    attempt: int  # 0, then 1, 2, ... when the episode is dispatched again (its worker was lost)
    problem_id: str
    problem: dict
    seed: int
    version: int
    problem_episodes: int = 1  # episodes of this iteration that run `problem_id` (the trainer's streamed step
    # computes a problem's samples once all of them are in: its advantages are relative to them all)
    trainer_ranks: dict = dataclasses.field(default_factory=dict)  # cluster.leases: policy -> the trainer rank
    # its Groups go to straight (a policy missing: rank 0)


@dataclass(slots=True)
class EpisodeDone(Message):
    """env worker -> router: an episode ended (its Groups were sent before this message)."""

    KIND = Kind.EPISODE_DONE
    HEADER = 5
    episode_id: str
    iteration: int
    mode: str
    attempt: int  # the RunEpisode's; a result of an abandoned attempt is dropped and counted
    error: str  # "" when the episode ran; else why it failed (it is counted as dropped)
    summary: dict  # success, reward/<agent>, turns, tokens
    samples: dict  # policy -> number of samples sent in Groups for this episode
    leases: dict = dataclasses.field(default_factory=dict)  # cluster.leases: what the worker's lease client
    # did since its previous EpisodeDone, {"direct": Generates sent straight to a replica, "resent": requests of
    # a replica that left its lease sent again, "stale": results dropped (no longer that replica's)}; {} otherwise


@dataclass(slots=True)
class Groups(Message):
    """env worker -> router -> trainer of `policy`: the recorded groups of one episode. The router holds
    them until the episode's EpisodeDone (same attempt) arrives, then forwards them; groups of a failed
    or abandoned attempt never reach a trainer. When groups stream by turn (`Config.streams_turns`), each
    group comes as it is recorded and is forwarded at once; a failed or abandoned attempt's are then
    `Withdrawn`. With cluster.leases: env worker -> trainer straight, held
    there until the router accepts the attempt (`Accepted`)."""

    KIND = Kind.GROUPS
    HEADER = 6
    policy: str
    iteration: int
    episode_id: str
    attempt: int
    n_samples: int
    n_tokens: int  # prompt + completion tokens of the samples: the router balances trainer ranks by it
    samples: list  # samples_to_wire(samples): a prompt shared with an earlier sample is sent once
    problem_episodes: int = 1  # the RunEpisode's: episodes of the iteration that run this episode's problem


@dataclass(slots=True)
class GroupsReceived(Message):
    """trainer -> env worker (cluster.leases): the trainer holds that episode's Groups of `policy` (error ""),
    or refused them (error: why). The worker sends the episode's EpisodeDone only after this, so an episode
    the router accepts has its groups at the trainer already, whatever happens to the worker later."""

    KIND = Kind.GROUPS_RECEIVED
    HEADER = 4
    policy: str
    iteration: int
    episode_id: str
    attempt: int
    error: str


NO_SEED = -1
"""Generate.seed of a request without one."""
MAX_SEED = 2**63 - 1
"""The largest Generate.seed (an int64; seed + i stays within what torch.Generator.manual_seed takes)."""
MAX_TOP_LOGPROBS = 20
"""The most alternatives per sampled token a Generate may ask (OpenAI's and vLLM's default limit)."""


@dataclass(slots=True)
class Generate(Message):
    """env worker -> router -> an inference server of `policy`: sample n completions of a prompt (with
    cluster.leases: env worker -> a replica its `Lease` names, directly)."""

    KIND = Kind.GENERATE
    HEADER = 4
    request_id: int  # unique per origin
    policy: str
    origin: str  # identity of the requesting env worker; the reply is routed back to it
    deadline: float  # unix time after which the result is useless
    prompt_ids: np.ndarray  # int32[P]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    greedy: bool
    stop_token_ids: list
    seed: int = NO_SEED  # 0..MAX_SEED: sample i of the n draws from a generator seeded with seed + i (vLLM's
    # rule), so the request is reproducible whatever it is batched with; NO_SEED: the server's own generator
    top_logprobs: int = 0  # 0..MAX_TOP_LOGPROBS alternatives per sampled token (0: none, nothing extra computed)


@dataclass(slots=True)
class GenerateResult(Message):
    """inference server -> router -> env worker `origin`: the n completions of request `request_id` (a request
    that came directly: back on the connection it came over)."""

    KIND = Kind.GENERATE_RESULT
    HEADER = 3
    request_id: int
    origin: str
    error: str  # "" on success
    completions: list  # [completion_to_wire(c), ...] (n entries; with alternatives only if the request asked)


@dataclass(slots=True)
class Lease(Message):
    """router -> env worker (cluster.leases): the live replicas of `policy` the worker sends its Generates to,
    straight to their endpoints; the complete set, sent when the worker joins and whenever it changes (a
    replica joins, is lost, or its replacement serves). Empty: none is live now, the worker's Generates of
    `policy` go through the router (which holds them while the replicas are replaced)."""

    KIND = Kind.LEASE
    HEADER = 1
    policy: str
    replicas: list  # [[replica name, endpoint "tcp://<address>:<port>"], ...]


@dataclass(slots=True)
class Trainers(Message):
    """router -> env worker (cluster.leases): every trainer process's direct endpoint, sent when the worker
    joins; an episode's Groups go straight to the trainer rank its RunEpisode names (`trainer_ranks`)."""

    KIND = Kind.TRAINERS
    HEADER = 0
    endpoints: list  # [[trainer name, endpoint "tcp://<address>:<port>"], ...]


# ---- training and weight sync -------------------------------------------------------------------


@dataclass(slots=True)
class TrainStep(Message):
    """router -> trainer: every episode of `iteration` is in; step from `version` to `version + 1`."""

    KIND = Kind.TRAIN_STEP
    HEADER = 4
    policy: str
    iteration: int
    version: int
    expected_samples: int  # samples the router forwarded; the trainer checks it got exactly these
    checkpoint_first: bool = False  # save the weights of `version` before stepping (a new best evaluation)
    checkpoint_after: bool = False  # save the weights of `version + 1` after stepping (the run stops there)


@dataclass(slots=True)
class Trained(Message):
    """trainer -> router: the step is done and weights `version` were broadcast."""

    KIND = Kind.TRAINED
    HEADER = 3
    policy: str
    version: int
    error: str
    metrics: dict  # version_mismatch, logprob_abs_diff, loss, ..., time/train_s, time/weight_sync_s


@dataclass(slots=True)
class UpdateWeights(Message):
    """trainer -> router -> every inference server of `policy`: join the broadcast of `version` now, in
    generation `generation` of the weight group (a replica in another generation ignores it)."""

    KIND = Kind.UPDATE_WEIGHTS
    HEADER = 3
    policy: str
    version: int
    generation: int


@dataclass(slots=True)
class WeightsLoaded(Message):
    """inference server -> router: weights `version` are loaded (or `error` says why not)."""

    KIND = Kind.WEIGHTS_LOADED
    HEADER = 4
    policy: str
    version: int
    replica: str
    error: str


@dataclass(slots=True)
class ReformWeightGroup(Message):
    """router -> the trainer (rank 0) and every inference server of `policy`: the policy's replicas changed
    (one was lost, or a replacement is ready); form generation `generation` of the weight group with the
    replicas `members`, replica i being rank 1 + members.index(i). When `fresh` is not empty, generation
    `generation - 1` is first formed by the trainer and the replicas `fresh` alone (rank 1 + fresh.index(i)),
    and the trainer sends them its current version there: a replacement receives only the version the
    others hold, and they receive nothing (docs/faults.md)."""

    KIND = Kind.REFORM_WEIGHT_GROUP
    HEADER = 2
    policy: str
    generation: int
    members: list  # [replica index, ...] in rank order
    fresh: list  # [replica index, ...]: members that catch up first


@dataclass(slots=True)
class Accepted(Message):
    """router -> trainer (cluster.leases): episodes of `iteration` that are done, whose Groups of `policy` the
    env worker that ran them sent straight to this trainer; only these train (any other attempt's are dropped).
    The router counts their samples into the TrainStep's `expected_samples`."""

    KIND = Kind.ACCEPTED
    HEADER = 2
    policy: str
    iteration: int
    episodes: list  # [[episode id, attempt, env worker name, samples], ...]


@dataclass(slots=True)
class Withdrawn(Message):
    """router -> trainer (`Config.streams_turns`): the Groups of `policy` that this attempt of the episode sent
    before its end were forwarded at once, and the attempt failed or was abandoned: they must not train."""

    KIND = Kind.WITHDRAWN
    HEADER = 4
    policy: str
    iteration: int
    episode_id: str
    attempt: int


MESSAGES: dict[int, type[Message]] = {
    cls.KIND: cls
    for cls in (
        Hello, Welcome, Heartbeat, Shutdown, RunEpisode, EpisodeDone, Groups, GroupsReceived,
        Generate, GenerateResult, Lease, Trainers, TrainStep, Trained, UpdateWeights, WeightsLoaded, ReformWeightGroup,
        Accepted, Withdrawn,
    )
}  # fmt: skip


# ---- encoding -----------------------------------------------------------------------------------

HEADERS: dict[int, type[tuple]] = {
    kind: collections.namedtuple(f"{cls.__name__}Header", [f.name for f in dataclasses.fields(cls)[: cls.HEADER]])
    for kind, cls in MESSAGES.items()
}
"""kind -> named view of its header fields (what `peek` returns)."""

_SIMPLE_TYPES = {"str": str, "int": int, "float": (int, float), "bool": bool, "dict": dict, "list": list}


@typing.no_type_check
def _field_checks(cls: type[Message]) -> list[tuple[str, tuple[type, ...] | type]]:
    checks = []
    for f in dataclasses.fields(cls):
        if f.type == "np.ndarray":
            checks.append((f.name, np.ndarray))
        else:
            checks.append((f.name, _SIMPLE_TYPES[f.type]))
    return checks


_CHECKS = {kind: _field_checks(cls) for kind, cls in MESSAGES.items()}
_HEADER_TYPES = {kind: tuple(expected for _, expected in _CHECKS[kind][: cls.HEADER]) for kind, cls in MESSAGES.items()}
"""kind -> the type of each header field, for `peek`'s one `isinstance` per field."""


def _check(cls: type[Message], values: list, start: int) -> None:
    """Raise CodecError naming the first of `values` (fields `start`.. of `cls`) of the wrong type."""
    for (name, expected), value in zip(_CHECKS[cls.KIND][start:], values, strict=True):
        if not isinstance(value, expected):
            raise CodecError(f"{cls.__name__}.{name}: expected {expected}, got {type(value).__name__}")


_NAMES = {kind: tuple(f.name for f in dataclasses.fields(cls)) for kind, cls in MESSAGES.items()}
"""kind -> the message's field names, in order (`dataclasses.fields` costs more than the packing it feeds)."""
_KIND_FRAMES = {kind: bytes([kind]) for kind in MESSAGES}


def encode(msg: Message) -> list[bytes]:
    """Message -> frames [kind, header, payload]."""
    kind = msg.KIND
    values = [getattr(msg, name) for name in _NAMES[kind]]
    return [_KIND_FRAMES[kind], pack(values[: msg.HEADER]), pack(values[msg.HEADER :])]


def peek(frames: list) -> tuple[type[Message], Any]:
    """Read the kind and header only (the router's hot path): the message class and a named view of
    its header fields, each of its declared type; raises CodecError if malformed. `frames` are bytes-like
    (zmq.Frame objects as received will do)."""
    if len(frames) != 3:
        raise CodecError(f"a message has 3 frames, got {len(frames)}")
    kind = bytes(frames[0])
    if len(kind) != 1 or kind[0] not in MESSAGES:
        raise CodecError(f"unknown message kind {kind!r}")
    cls = MESSAGES[kind[0]]
    header = unpack_header(frames[1])
    if not isinstance(header, list) or len(header) != cls.HEADER:
        raise CodecError(f"{cls.__name__}: header must be a list of {cls.HEADER} values")
    if not all(map(isinstance, header, _HEADER_TYPES[cls.KIND])):
        _check(cls, header, 0)
    return cls, HEADERS[cls.KIND](*header)


def decode(frames: list) -> Message:
    """Frames -> a typed message; raises CodecError on anything malformed (never crashes the caller)."""
    cls, header = peek(frames)
    payload = unpack(frames[2])
    fields = len(_CHECKS[cls.KIND])
    if not isinstance(payload, list) or cls.HEADER + len(payload) != fields:
        raise CodecError(f"{cls.__name__}: payload must be a list of {fields - cls.HEADER} values")
    _check(cls, payload, cls.HEADER)  # the header's types were checked by peek
    return cls(*header, *payload)


# ---- composite values ---------------------------------------------------------------------------

_SAMPLE_FIELDS = [f.name for f in dataclasses.fields(Sample)]


def sample_to_wire(sample: Sample) -> list[Any]:
    return [getattr(sample, name) for name in _SAMPLE_FIELDS]


def sample_from_wire(values: Any) -> Sample:
    if not isinstance(values, list) or len(values) != len(_SAMPLE_FIELDS):
        raise CodecError("malformed sample")
    sample = Sample(*values)
    for name in ("prompt_ids", "completion_ids", "logprobs"):
        if not isinstance(getattr(sample, name), np.ndarray):
            raise CodecError(f"sample.{name} must be a packed array")
    return sample


_PROMPT = _SAMPLE_FIELDS.index("prompt_ids")


def samples_to_wire(samples: list[Sample]) -> list[list[Any]]:
    """`sample_to_wire` of each sample, but a prompt equal to an earlier sample's is sent as that sample's
    index: a tree group's K candidates share one prompt, so an episode's prompts go once each, not K times."""
    first: dict[bytes, int] = {}
    wire = []
    for index, sample in enumerate(samples):
        values = sample_to_wire(sample)
        prompt = np.ascontiguousarray(sample.prompt_ids)
        key = prompt.dtype.str.encode() + prompt.tobytes()
        if key in first:
            values[_PROMPT] = first[key]
        else:
            first[key] = index
        wire.append(values)
    return wire


def samples_from_wire(values: Any) -> list[Sample]:
    """The samples of `samples_to_wire`: a prompt sent as an index is that earlier sample's (the same array)."""
    if not isinstance(values, list):
        raise CodecError("malformed samples")
    samples: list[Sample] = []
    for entry in values:
        if isinstance(entry, list) and len(entry) == len(_SAMPLE_FIELDS) and type(entry[_PROMPT]) is int:
            if not 0 <= entry[_PROMPT] < len(samples):
                raise CodecError("a sample's prompt refers to no earlier sample")
            entry = [*entry[:_PROMPT], samples[entry[_PROMPT]].prompt_ids, *entry[_PROMPT + 1 :]]
        samples.append(sample_from_wire(entry))
    return samples


def completion_to_wire(c: Completion) -> list[Any]:
    """[ids, logprobs, version, finish_reason], plus [top_ids int32[T*k], top_logprobs float32[T*k]] (row
    by row) only when the completion carries alternatives: an ordinary completion costs no extra byte."""
    values = [c.token_ids, c.logprobs, c.version, c.finish_reason]
    if c.top_ids is not None and c.top_logprobs is not None:
        values += [np.asarray(c.top_ids, np.int32).reshape(-1), np.asarray(c.top_logprobs, np.float32).reshape(-1)]
    return values


def completion_from_wire(values: Any) -> Completion:
    if not isinstance(values, list) or len(values) not in (4, 6):
        raise CodecError("malformed completion")
    token_ids, logprobs, version, finish_reason = values[:4]
    arrays = [token_ids, logprobs, *values[4:]]
    if not all(isinstance(a, np.ndarray) for a in arrays):
        raise CodecError("completion arrays must be packed arrays")
    if len(values) == 4:
        return Completion(token_ids, logprobs, int(version), str(finish_reason))
    top_ids, top_logprobs = values[4:]
    steps = len(token_ids)
    if len(top_ids) != len(top_logprobs) or (len(top_ids) % steps if steps else len(top_ids)):
        raise CodecError(f"completion alternatives of {len(top_ids)} ids and {len(top_logprobs)} log-probs "
                         f"do not fill {steps} positions")  # fmt: skip
    k = len(top_ids) // steps if steps else 0
    shape = (steps, k)
    return Completion(token_ids, logprobs, int(version), str(finish_reason), top_ids.reshape(shape),
                      top_logprobs.reshape(shape))  # fmt: skip
