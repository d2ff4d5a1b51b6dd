"""Wire codec: round trips, packed arrays, and rejection of malformed or oversized frames."""

from __future__ import annotations

import random
import tracemalloc

import msgpack
import numpy as np
import pytest

from mas_async.wire.codec import MAX_OBJECTS, CodecError, pack, unpack
from mas_async.wire.messages import (
    HEADERS,
    MAX_SEED,
    MESSAGES,
    NO_SEED,
    PROTOCOL_VERSION,
    Accepted,
    EpisodeDone,
    Generate,
    GenerateResult,
    Groups,
    GroupsReceived,
    Hello,
    Kind,
    Lease,
    RunEpisode,
    Trainers,
    completion_from_wire,
    completion_to_wire,
    decode,
    encode,
    peek,
    sample_from_wire,
    sample_to_wire,
    samples_from_wire,
    samples_to_wire,
)
from mas_async.wire.samples import Completion, Sample


def _generate() -> Generate:
    return Generate(7, "vertical", "env_worker/0", 123.5, np.arange(60, dtype=np.int32), 8, 1, 1.0, 1.0, False, [2])


def test_generate_round_trip_keeps_types_and_arrays():
    msg = _generate()
    back = decode(encode(msg))
    assert isinstance(back, Generate)
    assert back.prompt_ids.dtype == np.int32
    np.testing.assert_array_equal(back.prompt_ids, msg.prompt_ids)
    assert (back.request_id, back.policy, back.n, back.stop_token_ids) == (7, "vertical", 8, [2])


def test_arrays_travel_as_packed_binary_not_lists():
    ids = np.arange(1000, dtype=np.int32)
    frame = pack([ids])
    assert len(frame) < 4 * 1000 + 16  # 4 bytes per int32 plus a few bytes of framing
    raw = msgpack.unpackb(frame, raw=False)
    assert isinstance(raw[0], msgpack.ExtType)
    np.testing.assert_array_equal(unpack(frame)[0], ids)


def test_float32_logprobs_round_trip_bit_exact():
    lp = np.random.default_rng(0).normal(size=33).astype(np.float32)
    c = completion_from_wire(unpack(pack(completion_to_wire(Completion(np.arange(33, dtype=np.int32), lp, 5)))))
    assert c.logprobs.dtype == np.float32 and c.version == 5
    np.testing.assert_array_equal(c.logprobs, lp)


def test_sample_round_trip():
    s = Sample(
        "e/vertical/0", "e", "p1", "vertical", "pv", 0, np.arange(5, dtype=np.int32),
        np.array([3], dtype=np.int32), np.array([-0.5], dtype=np.float32), 2, 0.25, True, 1.0, {"x": 1},
    )  # fmt: skip
    msg = Groups("pv", 3, "e", 0, 1, 7, [sample_to_wire(s)])
    back = sample_from_wire(decode(encode(msg)).samples[0])
    assert back.group == s.group and back.version == 2 and back.reward == 0.25 and back.info == {"x": 1}
    np.testing.assert_array_equal(back.prompt_ids, s.prompt_ids)


def test_an_episodes_samples_send_each_prompt_once_and_come_back_equal():
    """`samples_to_wire`: the K candidates of a turn share its prompt, which is sent once (the others name the
    sample that carries it); every sample comes back equal, and a reference to no earlier sample is refused."""

    def sample(turn: int, k: int) -> Sample:
        prompt = np.arange(400, dtype=np.int32) + turn  # a copy per candidate, equal within a turn
        completion = np.array([k, turn], dtype=np.int32)
        return Sample(f"e/a/{turn}", "e", "p", "a", "pv", turn, prompt, completion, np.zeros(2, np.float32), 0, k)

    samples = [sample(turn, k) for turn in range(3) for k in range(4)]
    msg = Groups("pv", 0, "e", 0, len(samples), 0, samples_to_wire(samples))
    frames = encode(msg)
    alone = encode(Groups("pv", 0, "e", 0, len(samples), 0, [sample_to_wire(s) for s in samples]))
    assert len(frames[2]) < 0.4 * len(alone[2])  # 3 prompts of 1.6 KB sent instead of 12
    back = samples_from_wire(decode(frames).samples)
    assert len(back) == len(samples)
    for got, sent in zip(back, samples, strict=True):
        np.testing.assert_array_equal(got.prompt_ids, sent.prompt_ids)
        np.testing.assert_array_equal(got.completion_ids, sent.completion_ids)
        assert (got.group, got.turn, got.reward) == (sent.group, sent.turn, sent.reward)
    wire = samples_to_wire(samples)
    wire[0][6] = 3  # the first sample's prompt "refers" to a later one
    with pytest.raises(CodecError, match="no earlier sample"):
        samples_from_wire(wire)


def test_peek_reads_the_header_without_the_payload():
    frames = encode(_generate())
    frames[2] = b"\xc1 garbage that is never decoded"
    cls, header = peek(frames)
    assert cls is Generate and tuple(header) == (7, "vertical", "env_worker/0", 123.5)
    assert (header.request_id, header.policy, header.origin, header.deadline) == (7, "vertical", "env_worker/0", 123.5)
    with pytest.raises(CodecError):
        decode(frames)


def test_header_views_name_the_leading_fields_of_every_message():
    import dataclasses

    for kind, cls in MESSAGES.items():
        names = [f.name for f in dataclasses.fields(cls)][: cls.HEADER]
        assert list(HEADERS[kind]._fields) == names


def test_every_message_kind_is_registered_once():
    assert sorted(MESSAGES) == sorted(int(k) for k in Kind)


@pytest.mark.parametrize(
    "frames",
    [
        [b"\x63", pack([1]), pack([])],  # unknown kind
        [b"", pack([]), pack([])],  # empty kind
        [bytes([Kind.HELLO]), b"\xc1", pack([])],  # invalid msgpack
        [bytes([Kind.HELLO]), pack(["a"]), pack([])],  # wrong header length
        [bytes([Kind.HELLO]), pack(["r", "id", "", 1, 1, "not-an-int"]), pack([])],  # wrong type
        [bytes([Kind.HEARTBEAT]), pack([1.0])],  # missing frame
        [bytes([Kind.GENERATE_RESULT]), pack([1, "o", ""]), pack([[1, 2]]) + b"extra"],  # trailing bytes
    ],
)
def test_malformed_frames_raise_codec_error(frames):
    with pytest.raises(CodecError):
        decode(frames)


@pytest.mark.parametrize(
    ("kind", "header", "field"),
    [
        (Kind.GROUPS, ["vertical", [1], "train0-0", 0, 4, 40], "iteration"),  # unhashable: a dict key downstream
        (Kind.GROUPS, ["vertical", 0, "train0-0", 0, "4", 40], "n_samples"),
        (Kind.GENERATE, [1, 2, "env_worker/0", 0.0], "policy"),
        (Kind.GENERATE, [1, "vertical", "env_worker/0", "soon"], "deadline"),
        (Kind.GENERATE_RESULT, [1, None, ""], "origin"),
        (Kind.GENERATE_RESULT, [{"a": 1}, "env_worker/0", ""], "request_id"),
        (Kind.HEARTBEAT, ["now"], "sent_at"),
    ],
)
def test_peek_checks_the_types_of_the_header_fields(kind, header, field):
    """The router's hot path reads headers through peek alone: a wrong-typed field must be a CodecError
    (counted), never a value that breaks the router further on."""
    with pytest.raises(CodecError, match=rf"\.{field}: expected"):
        peek([bytes([kind]), pack(header), pack([])])


def test_peek_takes_ints_for_float_fields():
    _, header = peek([bytes([Kind.HEARTBEAT]), pack([3]), pack([])])
    assert header.sent_at == 3


def test_oversized_frame_is_rejected_before_decoding():
    with pytest.raises(CodecError, match="exceeds"):
        unpack(pack(b"x" * 2000), max_bytes=1000)


def test_oversized_header_is_rejected():
    frames = encode(Hello("env_worker", "x" * 100_000, "", 1, 1, 1))
    with pytest.raises(CodecError, match="exceeds"):
        peek(frames)


def test_bad_array_ext_is_rejected():
    frame = msgpack.packb([msgpack.ExtType(1, bytes([1]) + b"abc")])  # 3 bytes is not a whole int32
    with pytest.raises(CodecError, match="malformed array"):
        unpack(frame)
    with pytest.raises(CodecError, match="unknown msgpack ext"):
        unpack(msgpack.packb([msgpack.ExtType(9, b"x")]))


def test_pickle_style_objects_cannot_be_sent():
    with pytest.raises(TypeError):
        pack([object()])


def test_result_with_error_round_trips():
    back = decode(encode(GenerateResult(3, "env_worker/1", "deadline passed", [])))
    assert back.error == "deadline passed" and back.completions == []


def _amplifying_frame(rng: random.Random, size: int) -> bytes:
    """A hostile frame of about `size` bytes whose elements are what costs most per byte once decoded:
    empty arrays, empty maps, short strings, maps of arrays, nested a random number of levels deep."""
    atoms = [b"\x90", b"\x80", b"\xa2ab", b"\x81\xa1k\x90", b"\x91\x90", b"\xc0"]
    body, count = b"", 0
    while len(body) < size:
        run = rng.randrange(1, 5000)
        body += rng.choice(atoms) * run
        count += run
    frame = b"\xdd" + count.to_bytes(4, "big") + body
    for _ in range(rng.randrange(0, 4)):  # wrapped in a few one-element arrays
        frame = b"\x91" + frame
    return frame


def test_decoding_is_bounded_in_objects_not_only_in_bytes():
    """Fuzz (seeded): 40 frames of up to 4 MB built to grow as they decode (an empty array is 1 byte on the
    wire, a 64-byte list in memory) each raise CodecError naming the object budget, and decoding any of them
    never holds more than 64 MB (unbounded, one 4 MB frame of empty arrays decodes to ~260 MB)."""
    rng = random.Random(38)
    peaks = []
    for _ in range(40):
        frame = _amplifying_frame(rng, rng.randrange(MAX_OBJECTS, 4 << 20))
        tracemalloc.start()
        try:
            with pytest.raises(CodecError, match=f"more than {MAX_OBJECTS} objects|exceeds max_array_len"):
                unpack(frame)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert max(peaks) < 64 << 20, max(peaks)


def test_a_header_decodes_without_the_object_budget_yet_bounded_by_its_size():
    """The router's header decode (`unpack_header`, no Python hooks): a header frame of nothing but nested empty
    arrays, at the header size limit, decodes to a few MB at most; one byte more is refused before decoding;
    malformed bytes are a CodecError; peek takes the frames as zmq delivers them."""
    import zmq

    from mas_async.wire.codec import MAX_HEADER_BYTES, unpack_header

    count = MAX_HEADER_BYTES - 5
    frame = b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count
    tracemalloc.start()
    try:
        assert len(unpack_header(frame)) == count
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak
    with pytest.raises(CodecError, match="exceeds"):
        unpack_header(frame + b"\x90")
    with pytest.raises(CodecError, match="malformed"):
        unpack_header(b"\x94\x01")
    frames = encode(
        Generate(7, "vertical", "env_worker/0", 1.5, np.arange(4, dtype=np.int32), 2, 8, 1.0, 1.0, False, [])
    )
    cls, header = peek([zmq.Frame(f) for f in frames])
    assert cls is Generate and header == peek(frames)[1] and header.request_id == 7


def test_real_messages_stay_far_below_the_object_budget():
    """A Groups payload of 160 samples (an episode of 2 agents, 10 turns, K = 8) decodes, and a caller that
    reads its own large files may raise the budget."""
    ids, logprobs = np.arange(50, dtype=np.int32), np.zeros(50, np.float32)
    sample = Sample("e/a/0", "e", "p", "a", "vertical", 0, np.arange(200, dtype=np.int32), ids, logprobs, 0, 0.5,
                    info={"parsed": True, "reward/local": 0.1})  # fmt: skip
    groups = Groups("vertical", 0, "train0-0", 0, 160, 40_000, [sample_to_wire(sample)] * 160)
    assert len(decode(encode(groups)).samples) == 160
    many = pack([[1, 2]] * MAX_OBJECTS)
    with pytest.raises(CodecError, match="objects"):
        unpack(many)
    assert len(unpack(many, max_objects=8 * MAX_OBJECTS)) == MAX_OBJECTS


def test_generate_carries_a_seed_and_top_logprobs_and_defaults_to_neither():
    assert (_generate().seed, _generate().top_logprobs) == (NO_SEED, 0)  # what a node-class request sends
    msg = _generate()
    msg.seed, msg.top_logprobs = MAX_SEED, 20
    back = decode(encode(msg))
    assert (back.seed, back.top_logprobs) == (MAX_SEED, 20)


def test_a_completion_carries_alternatives_only_when_it_has_them():
    ids, lp = np.array([4, 9, 2], dtype=np.int32), np.array([-0.1, -0.2, -0.3], dtype=np.float32)
    plain = completion_to_wire(Completion(ids, lp, 5, "stop"))
    assert len(plain) == 4  # no extra byte on an ordinary completion
    back = completion_from_wire(unpack(pack(plain)))
    assert back.top_ids is None and back.top_logprobs is None
    top_ids = np.array([[4, 1], [9, 8], [3, 2]], dtype=np.int32)
    top_lp = np.array([[-0.1, -2.0], [-0.2, -1.9], [-0.5, -0.3]], dtype=np.float32)
    wire = completion_to_wire(Completion(ids, lp, 5, "stop", top_ids, top_lp))
    assert len(pack(wire)) > len(pack(plain)) + 6 * 4 + 6 * 4
    back = completion_from_wire(decode(encode(GenerateResult(7, "env_worker/0", "", [wire]))).completions[0])
    assert back.top_ids.dtype == np.int32 and back.top_logprobs.dtype == np.float32
    np.testing.assert_array_equal(back.top_ids, top_ids)
    np.testing.assert_array_equal(back.top_logprobs, top_lp)
    np.testing.assert_array_equal(back.token_ids, ids)
    with pytest.raises(CodecError, match="do not fill"):
        completion_from_wire([ids, lp, 5, "stop", top_ids.reshape(-1)[:5], top_lp.reshape(-1)[:5]])
    with pytest.raises(CodecError):
        completion_from_wire([ids, lp, 5, "stop", top_ids.reshape(-1)])


def test_a_lease_a_replica_s_endpoint_and_a_worker_s_lease_counts_round_trip():
    """cluster.leases (protocol 8): the router's Lease to the env workers, the endpoint in a replica's Hello and
    the lease counts of an EpisodeDone; each is a field appended last, so a peer without them sends the defaults."""
    lease = Lease(
        "vertical", [["inference/vertical/0", "tcp://10.0.0.2:40111"], ["inference/vertical/1", "tcp://[::1]:5"]]
    )
    cls, header = peek(encode(lease))
    assert cls is Lease and tuple(header) == ("vertical",)
    assert decode(encode(lease)) == lease and decode(encode(Lease("vertical", []))).replicas == []
    hello = Hello("inference", "inference/vertical/0", "vertical", 8, PROTOCOL_VERSION, 12, 0.0, "tcp://10.0.0.2:40111")
    assert decode(encode(hello)).endpoint == "tcp://10.0.0.2:40111"
    assert Hello("env_worker", "env_worker/0", "", 2, PROTOCOL_VERSION, 13).endpoint == ""
    assert len(peek(encode(hello))[1]) == 6  # the router reads a Hello whole; its header is as it was
    done = EpisodeDone("train0-0", 0, "train", 0, "", {}, {"vertical": 4}, {"direct": 3, "resent": 1, "stale": 1})
    assert decode(encode(done)).leases == {"direct": 3, "resent": 1, "stale": 1}
    assert EpisodeDone("train0-0", 0, "train", 0, "", {}, {}).leases == {}
    with pytest.raises(CodecError, match="Lease.replicas"):
        decode([bytes([Kind.LEASE]), pack(["vertical"]), pack(["not a list"])])


def test_the_trainers_endpoints_an_acceptance_and_an_episode_s_trainer_ranks_round_trip():
    """cluster.leases (protocol 9): the trainers' endpoints to the env workers, the router's acceptance of
    episodes whose groups went straight to a trainer (its header the policy and iteration), a trainer's
    answer to a worker's groups, and the trainer ranks a RunEpisode names, a field appended last (without
    it: every policy's rank 0)."""
    trainers = Trainers([["trainer/vertical", "tcp://10.0.0.2:40111"], ["trainer/vertical/1", "tcp://[::1]:5"]])
    assert decode(encode(trainers)) == trainers and peek(encode(trainers))[0] is Trainers
    accepted = Accepted("vertical", 3, [["train3-1-0", 1, "env_worker/0", 8]])
    cls, header = peek(encode(accepted))
    assert cls is Accepted and tuple(header) == ("vertical", 3)
    assert decode(encode(accepted)) == accepted
    run = RunEpisode("train3-1-0", 3, "train", 1, "p1", {}, 7, 3, 2, {"vertical": 1})
    assert decode(encode(run)).trainer_ranks == {"vertical": 1}
    assert RunEpisode("train3-1-0", 3, "train", 1, "p1", {}, 7, 3).trainer_ranks == {}
    received = GroupsReceived("vertical", 3, "train3-1-0", 1, "its policy is not this trainer's")
    cls, header = peek(encode(received))
    assert cls is GroupsReceived and tuple(header) == ("vertical", 3, "train3-1-0", 1)
    assert decode(encode(received)) == received
    with pytest.raises(CodecError, match="Accepted.episodes"):
        decode([bytes([Kind.ACCEPTED]), pack(["vertical", 3]), pack(["not a list"])])
