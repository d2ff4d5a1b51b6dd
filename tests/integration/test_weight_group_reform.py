"""Re-forming a weight group after a receiver is lost, between real processes on loopback (gloo).

Rank 0 runs in the test; the receivers are spawned processes driven by command queues, so the test
decides when each joins a generation and receives. Every child is killed by pid in a `finally`, and
every wait has a bound, so a failure never hangs the suite.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import threading
import time
from typing import Any

import pytest
import torch

from mas_async import preloaded_processes
from mas_async.weights.group import (
    POLL_S,
    GroupRetired,
    WeightSyncError,
    open_weight_group,
    retire_generation,
)
from mas_async.weights.receiver import WeightReceiver
from mas_async.weights.sender import WeightSender

WAIT_S = 60.0
PROMPT_S = 10 * POLL_S + 5
"""A wait that must end at once, not at the group's bound (WAIT_S): spawn and rendezvous take a second or two."""
WORLD = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tensors(version: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(version)
    return [(f"layer.{i}.weight", torch.randn(64, 64, generator=g)) for i in range(4)]


def _receiver(port: int, rank: int, commands: Any, out: Any) -> None:
    """Join a generation ("join", g) or receive a version ("receive",) on command; report each outcome."""
    torch.set_num_threads(1)
    out.put((rank, "ready"))
    receiver = None
    while True:
        command = commands.get(timeout=WAIT_S)
        started = time.monotonic()
        try:
            if command[0] == "join":
                if receiver is not None:  # as a server does: the generation it replaces is given up
                    receiver.group.retire()
                group = open_weight_group(
                    policy="pi", backend="gloo", host="127.0.0.1", port=port, rank=rank, world_size=WORLD,
                    timeout_s=WAIT_S, generation=command[1],
                )  # fmt: skip
                receiver = WeightReceiver(group)
                out.put((rank, "joined", command[1], time.monotonic() - started))
            else:
                assert receiver is not None
                version, tensors = receiver.receive()
                same = all(torch.equal(t, want) for (_, t), (_, want) in zip(tensors, _tensors(version), strict=True))
                out.put((rank, "received", version, same))
        except GroupRetired as e:
            out.put((rank, "retired", str(e), time.monotonic() - started))
        except WeightSyncError as e:  # the group broke under it (its pair with the lost rank): as good
            out.put((rank, "broken", str(e), time.monotonic() - started))


class _Receivers:
    """The receiver processes, each with its own command and report queues: a queue shared with a process
    that is SIGKILLed may be left locked by it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.ctx = preloaded_processes.context()
        self.procs: dict[int, Any] = {}
        self.commands: dict[int, Any] = {}
        self.outs: dict[int, Any] = {}

    def start(self, *ranks: int) -> None:
        """Start receivers `ranks` and wait until they run (so their joins are not timed from their spawn)."""
        for rank in ranks:
            self.commands[rank], self.outs[rank] = self.ctx.Queue(), self.ctx.Queue()
            args = (self.port, rank, self.commands[rank], self.outs[rank])
            self.procs[rank] = self.ctx.Process(target=_receiver, args=args, daemon=True)
            self.procs[rank].start()
        assert self.reports(*ranks) == dict.fromkeys(ranks, ("ready",))

    def tell(self, rank: int, *command: Any) -> None:
        self.commands[rank].put(command)

    def reports(self, *ranks: int) -> dict[int, tuple]:
        """The next report of each of `ranks`."""
        got = {}
        for rank in ranks:
            try:
                got[rank] = tuple(self.outs[rank].get(timeout=WAIT_S))[1:]
            except queue.Empty:
                exits = {rank: proc.exitcode for rank, proc in self.procs.items()}
                raise AssertionError(
                    f"receiver {rank} sent no report in {WAIT_S} s (got {got}); receivers' exit codes {exits}"
                ) from None
        return got

    def kill(self, rank: int) -> None:
        os.kill(self.procs[rank].pid, signal.SIGKILL)
        self.procs[rank].join(WAIT_S)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(WAIT_S)


def _in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # reported to the test
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _open_rank0(port: int, generation: int, store: Any = None) -> Any:
    return open_weight_group(
        policy="pi", backend="gloo", host="127.0.0.1", port=port, rank=0, world_size=WORLD, timeout_s=WAIT_S,
        generation=generation, store=store,
    )  # fmt: skip


def _form(receivers: _Receivers, generation: int, store: Any = None) -> Any:
    """Every rank joins generation `generation`: receivers 1 and 2 on command, rank 0 here; rank 0's group."""
    for rank in (1, 2):
        receivers.tell(rank, "join", generation)
    thread, box = _in_thread(lambda: _open_rank0(receivers.port, generation, store))
    joins = receivers.reports(1, 2)
    assert {r[0] for r in joins.values()} == {"joined"}, joins
    assert all(r[2] < PROMPT_S for r in joins.values()), joins  # not held up by a generation given up
    thread.join(WAIT_S)
    return box["value"]


def test_a_lost_receiver_is_replaced_in_a_new_generation_and_the_live_one_stops_waiting() -> None:
    """Receiver 2 is SIGKILLed; rank 0's send of v2 fails, it retires generation 0, and receiver 1, waiting
    for the rest of v2, gives up at once (the retired key, or its pair with rank 0 or the lost rank
    closed), not at the group's 60 s bound. A new receiver 2 joins generation 1 with the others on the
    same store, at once too (the abandoned work of generation 0 does not hold receiver 1 up), and v2
    reaches both whole."""
    receivers = _Receivers(_free_port())
    try:
        receivers.start(1, 2)
        group = _form(receivers, 0)
        sender = WeightSender(group, bucket_bytes=64 * 64 * 4)  # a bucket per tensor: v2 is several broadcasts
        for rank in (1, 2):
            receivers.tell(rank, "receive")
        sender.send(1, _tensors(1))
        assert receivers.reports(1, 2) == {1: ("received", 1, True), 2: ("received", 1, True)}

        receivers.kill(2)
        receivers.tell(1, "receive")
        with pytest.raises(WeightSyncError):
            sender.send(2, _tensors(2))
        group.retire()
        report = receivers.reports(1)[1]
        assert report[0] in ("retired", "broken") and report[2] < PROMPT_S, report  # not at the group's bound

        receivers.start(2)
        sender = WeightSender(_form(receivers, 1, store=group.store), bucket_bytes=64 * 64 * 4)
        for rank in (1, 2):
            receivers.tell(rank, "receive")
        sender.send(2, _tensors(2))
        assert receivers.reports(1, 2) == {1: ("received", 2, True), 2: ("received", 2, True)}
    finally:
        receivers.close()


def test_a_generation_retired_before_every_rank_joined_frees_those_waiting_in_it() -> None:
    """Rank 0 and receiver 1 start joining generation 1, receiver 2 never comes (it was lost again): rank 0
    retires the generation, and both stop waiting at once with GroupRetired; generation 2 then forms."""
    port = _free_port()
    receivers = _Receivers(port)
    try:
        receivers.start(1, 2)
        store = _form(receivers, 0).store

        receivers.tell(1, "join", 1)
        thread, box = _in_thread(lambda: _open_rank0(port, 1, store=store))
        time.sleep(1.0)
        assert thread.is_alive()  # waiting for receiver 2
        retire_generation(store, "pi", 1)
        thread.join(5.0)
        assert not thread.is_alive() and isinstance(box.get("error"), GroupRetired), box
        report = receivers.reports(1)[1]
        assert report[0] == "retired" and "generation 1 was retired before every rank joined" in report[1]

        assert _form(receivers, 2, store=store).generation == 2
    finally:
        receivers.close()
