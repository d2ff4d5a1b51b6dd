"""A live run under a flood of malformed frames: 10,000 of them, seeded, sent over loopback to the router
as a CURVE client holding env worker 1's own key (leaked by a test role: what a buggy or hostile process of
the run could send), from other connections than the one that worker joined with, some of them frames
built to grow as they decode; and random bytes to the torch TCPStore ports of each policy.

The run must finish with status 0, no process may die on the way, every frame the router received must be
counted (`router/malformed` for what does not decode, `router/refused_messages` for well-formed messages
that do not come from a joined peer's own connection), every row must keep its shape, and the router's log must stay short and
printable (rate-limited warnings with counts)."""

from __future__ import annotations

import json
import random
import re
import socket
import threading
import time
from pathlib import Path

import numpy as np
import zmq

from mas_async.runtime.curve import secure_client
from mas_async.wire.codec import MAX_HEADER_BYTES, MAX_OBJECTS, pack
from mas_async.wire.messages import (
    MESSAGES,
    PROTOCOL_VERSION,
    EpisodeDone,
    Generate,
    GenerateResult,
    Groups,
    Heartbeat,
    Hello,
    Kind,
    ReformWeightGroup,
    RunEpisode,
    Shutdown,
    Trained,
    TrainStep,
    UpdateWeights,
    WeightsLoaded,
    Welcome,
    encode,
)
from tests.integration.launch import FAST, alive, child_pids, cleanup, start_train
from tests.support.leaky_roles import LEAKED

FRAMES = 10_000
SEND_S = 30.0
"""The flood stops after this long, sent or not (it takes a few seconds)."""
TCP_CONNECTIONS = 200
ITERATIONS = 12
"""Long enough that the run is still going when the flood ends: the last row must count every frame."""
POLICIES = ("vertical", "horizontal")


def _valid(rng: random.Random) -> list[bytes]:
    """A well-formed message of a kind a peer sends, with hostile values (forged, as a stranger would)."""
    policy = rng.choice([*POLICIES, "nobody", "", "\x00\xff"])
    huge = rng.choice([-1, -(2**63), 2**63 - 1, 2**64 - 1, 10**12])
    episode = rng.choice(["train0-0", "train3-1", "eval2-0", "", "x" * 1000])
    msg = rng.choice(
        [
            Generate(huge, policy, "env_worker/0", 1e12, np.arange(rng.randrange(0, 50), dtype=np.int32), huge,
                     huge, float("nan"), -1.0, False, [huge]),
            GenerateResult(rng.randrange(5), "env_worker/0", "", [[np.zeros(2, np.int32), np.zeros(2, np.float32),
                                                                    0, "stop"]]),
            Groups(policy, rng.choice([0, 1, huge]), episode, huge, huge, huge, [[1, 2, 3]]),
            EpisodeDone(episode, rng.choice([0, 1, huge]), rng.choice(["train", "eval", "bogus"]), huge, "",
                        {"success": 1.0, "tokens": "many"}, {policy: huge}),
            Trained(policy, huge, rng.choice(["", "boom"]), {"version_mismatch": 1}),
            UpdateWeights(policy, huge, huge),
            ReformWeightGroup(policy, rng.choice([-1, huge]), [huge, -1], [0]),
            WeightsLoaded(policy, huge, f"inference/{policy}/0", rng.choice(["", "boom"])),
            Heartbeat(float(huge)),
            Hello(rng.choice(["env_worker", "trainer", "router"]), rng.choice(["env_worker/0", "trainer/vertical"]),
                  policy, huge, rng.choice([PROTOCOL_VERSION, huge]), huge),
            Welcome(PROTOCOL_VERSION),
            Shutdown("fuzz", True),
            RunEpisode(episode, 0, "train", 0, "train1", {}, 0, 0),
            TrainStep(policy, 0, 0, huge),
        ]
    )  # fmt: skip
    return encode(msg)


def _malformed(rng: random.Random) -> list[bytes]:
    """A message that does not decode, of one of several shapes."""
    frames = _valid(rng)
    kind = rng.randrange(9)
    if kind == 0:  # truncated: the header or the payload cut short
        i = rng.randrange(1, 3)
        frames[i] = frames[i][: rng.randrange(len(frames[i]))]
        return frames
    if kind == 1:  # wrong frame count
        return rng.choice([frames[:1], frames[:2], [*frames, b"extra"], [*frames, *frames]])
    if kind == 2:  # oversized header (64 KiB is the limit)
        return [frames[0], pack(["x" * (MAX_HEADER_BYTES + rng.randrange(1, 4096))]), frames[2]]
    if kind == 3:  # unknown kind byte
        unknown = [k for k in range(256) if k not in MESSAGES]
        return [rng.choice([bytes([rng.choice(unknown)]), b"", b"\x0c\x0c"]), frames[1], frames[2]]
    if kind == 4:  # not msgpack at all
        return [frames[0], rng.choice([b"\xc1", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))]),
                frames[2]]  # fmt: skip
    if kind == 5:  # wrong msgpack types in the header
        header = rng.choice([[[1]] * 6, [{"a": 1}] * 4, [None] * 3, "header", 7, {"policy": "vertical"}, [1.5] * 6])
        return [rng.choice([bytes([Kind.GROUPS]), bytes([Kind.GENERATE]), bytes([Kind.GENERATE_RESULT]),
                            bytes([Kind.HELLO]), bytes([Kind.TRAINED])]), pack(header), frames[2]]  # fmt: skip
    if kind == 6:  # wrong types in the payload
        return [frames[0], frames[1], rng.choice([pack("payload"), pack([None] * 9), pack({"samples": []}), b""])]
    if kind == 7:  # a payload that would grow ~64 times as it decodes: a Hello's, which the router decodes
        count = rng.randrange(MAX_OBJECTS, 2 * MAX_OBJECTS)
        body = rng.choice([b"\x90", b"\x80", b"\x91\x90"]) * count
        return [bytes([Kind.HELLO]), encode(Hello("env_worker", "env_worker/0", "", 1, 1, 1))[1],
                b"\xdd" + count.to_bytes(4, "big") + body]  # fmt: skip
    return [frames[0], frames[1], b"\xc1" * rng.randrange(1, 1 << 20)]  # an oversized payload of garbage


def _message(rng: random.Random) -> list[bytes]:
    return _valid(rng) if rng.random() < 0.4 else _malformed(rng)


def _flood(endpoint: str, keys_dir: str, secret: str, seed: int, report: dict) -> None:
    """Send FRAMES messages (or as many as SEND_S allows) from 40 named and 10 unnamed CURVE DEALERs, each
    holding the key `secret`."""
    rng = random.Random(seed)
    ctx = zmq.Context()
    socks = []
    for i in range(50):
        sock = ctx.socket(zmq.DEALER)
        if i < 40:  # never a peer's name: random bytes, some not UTF-8 (a first byte 0 is ZeroMQ's own)
            ident = bytes([rng.randrange(1, 256)]) + rng.randbytes(rng.randrange(0, 40))
            sock.setsockopt(zmq.IDENTITY, rng.choice([ident, b"fuzz/" + ident]))
        sock.setsockopt(zmq.SNDTIMEO, 1000)
        sock.setsockopt(zmq.LINGER, 20_000)  # every message sent is delivered before the context closes
        secure_client(sock, keys_dir, secret)
        sock.connect(endpoint)
        socks.append(sock)
    sent, deadline = 0, time.monotonic() + SEND_S
    while sent < FRAMES and time.monotonic() < deadline:
        try:
            rng.choice(socks).send_multipart(_message(rng))
        except zmq.Again:
            continue
        sent += 1
    report["sent"] = sent
    report["send_s"] = SEND_S - (deadline - time.monotonic())
    for sock in socks:
        sock.close()  # with its linger: term waits until every queued message has left
    ctx.term()


def _garbage_tcp(ports: list[int], seed: int, report: dict) -> None:
    """Connect TCP_CONNECTIONS times to the torch TCPStore ports and send random bytes."""
    rng = random.Random(seed)
    connected = refused = 0
    for i in range(TCP_CONNECTIONS):
        try:
            with socket.create_connection(("127.0.0.1", ports[i % len(ports)]), timeout=2) as conn:
                conn.sendall(rng.randbytes(rng.randrange(1, 4096)))
                connected += 1
        except OSError:
            refused += 1
    report.update(tcp_connected=connected, tcp_refused=refused)


def _wait_for(path: Path, pattern: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and re.search(pattern, path.read_text(errors="replace")):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{pattern!r} never appeared in {path}")


def test_a_live_run_survives_a_flood_of_malformed_frames(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_train("configs/plan_path_tiny.yaml", run_dir, f"run.iterations={ITERATIONS}", *FAST,
                       runner="tests.support.leaky_roles")  # fmt: skip
    try:
        pids = child_pids(run_dir)
        router_log = run_dir / "logs" / "router.log"
        _wait_for(router_log, r"all \d+ peers joined", timeout=120)
        deployment = json.loads((run_dir / "deployment.json").read_text())
        report: dict = {}
        ports = [*deployment["weight_ports"].values(), *deployment["trainer_ports"].values()]
        threads = [
            threading.Thread(
                target=_flood,
                args=(deployment["router_endpoint"], deployment["keys_dir"], (run_dir / LEAKED).read_text(), 0, report),
                daemon=True,
            ),
            threading.Thread(target=_garbage_tcp, args=(ports, 1, report), daemon=True),
        ]
        t0 = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=SEND_S + 30)
        assert "sent" in report and "tcp_connected" in report, report
        report["flood_s"] = time.monotonic() - t0
        rows_after_flood = len((run_dir / "metrics.jsonl").read_text().splitlines())
        dead = [name for name, pid in pids.items() if not alive(pid)]
        assert not dead, f"{dead} died during the flood"
        out, _ = proc.communicate(timeout=180)
    finally:
        cleanup(proc, run_dir)
    print(f"fuzz: {report}")
    assert proc.returncode == 0, out
    assert report["sent"] == FRAMES, report

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(ITERATIONS + 1))
    assert len(rows) - rows_after_flood >= 3, "the run ended too soon after the flood: its last row may miss frames"
    # Every frame the router received is counted once: none goes uncounted, none is acted on. ZeroMQ drops
    # nothing here: the DEALERs block at their high-water mark rather than drop, the largest frame (1 MiB)
    # is far below MAXMSGSIZE (512 MiB), and the context's term waits for every queued message to leave.
    last = rows[-1]
    counted = last["router/malformed"] + last["router/refused_messages"]
    print(f"fuzz: malformed {last['router/malformed']}, refused {last['router/refused_messages']}")
    assert counted == FRAMES
    # The shape of any run's rows: every training iteration evaluates too (eval.every=1) and has the same
    # keys; the last one adds the final checkpoint's version; the final evaluation's row is a subset.
    # The baselines are played once, in the first evaluation (row 0), and only there.
    assert any(k.startswith("eval/baseline/") for k in rows[0])
    assert not any(k.startswith("eval/baseline/") for r in rows[1:] for k in r)
    # A policy's grad_norm and clip_fraction are measured only when some sample went through backward, and what
    # the optimiser changed only when it stepped: a step whose samples all had advantage 0 (every episode of each
    # problem scored alike) leaves the three out.
    backward_only = {f"policy/{p}/{k}" for p in POLICIES for k in ("grad_norm", "clip_fraction")}
    backward_only |= {f"trainer/{p}/changed_fraction" for p in POLICIES}
    for i, row in enumerate(rows[:-1]):
        for policy in POLICIES:
            measured = {
                f"policy/{policy}/grad_norm",
                f"policy/{policy}/clip_fraction",
                f"trainer/{policy}/changed_fraction",
            } & set(row)
            assert len(measured) == (3 if row[f"policy/{policy}/active_samples"] else 0), (i, policy, row)
    keys = [frozenset(k for k in r if not k.startswith("eval/baseline/")) - backward_only for r in rows]
    every = frozenset.union(*keys[:-2])
    assert len(set(keys[:-2])) == 1, (
        f"training rows differ in shape: {[(i, sorted(every - k)) for i, k in enumerate(keys[:-2]) if k != every]}"
    )
    assert keys[-2] == keys[0] | {f"policy/{p}/{k}" for p in POLICIES for k in ("checkpoint_version", "checkpoint_s")}
    assert keys[-1] < keys[0]
    assert {"router/malformed", "router/refused_messages", "router/refused_handshakes"} <= keys[-1]
    for policy in POLICIES:
        assert all(r[f"policy/{policy}/version_mismatch"] == 0 for r in rows[:-1])
    assert all(r["rollout/dropped"] == 0 for r in rows[:-1])

    log = router_log.read_bytes()
    assert all(32 <= b < 127 or b in (9, 10) for b in log), "the router's log holds raw bytes"
    flood = [line for line in log.decode().splitlines() if "dropped a" in line and "WARNING" in line]
    print(f"fuzz: router log {len(log.splitlines())} lines, {len(flood)} about the flood")
    assert 0 < len(flood) < 200
    assert all(re.search(r"\(\d+ (such )?so far", line) for line in flood)
    assert b"Traceback" not in log
    for name in pids:  # no process restarted or failed: one start, no traceback, in every log
        text = (run_dir / "logs" / f"{name.replace('/', '-')}.log").read_text(errors="replace")
        assert "Traceback" not in text, name
