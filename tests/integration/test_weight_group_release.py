"""A trainer whose replica is replaced again and again holds the same open files and threads: each generation of
the weight group it leaves is let go of, sockets, gloo threads and all.

Rank 0 is the real `WeightPublisher` in the test's process, fed the orders the router sends when a policy's
only replica is lost (a generation without members) and when its replacement is ready (a catch-up generation
with it alone, then the new one). Each replica is a real process (forked from a server that has imported
torch), joining and receiving as an inference server does (`retire_replaced`, then `open_receiver`); it is
SIGKILLed, as the soak does, idle or while a send to it is under way. The test's process holds nothing else
that grows: replicas talk over pipes (a multiprocessing Queue would leave a feeder thread per queue), and each
is closed with its process. Every child is killed by pid in a `finally`.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time
from typing import Any

import torch

from mas_async import preloaded_processes
from mas_async.deployment import free_ports
from mas_async.training.publisher import WeightPublisher
from mas_async.weights.group import WeightGroupSpec
from mas_async.wire.messages import ReformWeightGroup

WAIT_S = 60.0
REPLACEMENTS = 8
SETTLE_S = 5.0
"""How long a let-go generation may take to close (its sockets and gloo threads end off the caller's thread)."""


def _tensors(version: int) -> list[tuple[str, torch.Tensor]]:
    return [(f"layer.{i}.weight", torch.full((32, 32), float(version))) for i in range(3)]


def _replica(spec: WeightGroupSpec, conn: Any) -> None:
    """Run the commands `conn` brings, one after another, as a server does: ("join", generation, world_size)
    gives up the generation joined before and joins the new one; ("receive",) reports the version received."""
    from mas_async.weights.sync import open_receiver, retire_replaced

    torch.set_num_threads(1)
    receiver = None
    while True:
        command = conn.recv()
        if command[0] == "join":
            retire_replaced(receiver)
            receiver = open_receiver(**spec.join_args(1, command[1], world_size=command[2]))
            conn.send(("joined", command[1]))
        else:
            assert receiver is not None
            version, tensors = receiver.receive()
            conn.send(
                (
                    "received",
                    version,
                    all(torch.equal(t, want) for (_, t), (_, want) in zip(tensors, _tensors(version), strict=True)),
                )
            )


class _Replica:
    """One replica process and its end of the pipe; `close` kills it and releases both."""

    def __init__(self, ctx: Any, spec: WeightGroupSpec) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_replica, args=(spec, child), daemon=True)
        self.proc.start()
        child.close()

    def tell(self, *commands: tuple) -> None:
        for command in commands:
            self.conn.send(command)

    def report(self) -> tuple:
        if not self.conn.poll(WAIT_S):
            raise AssertionError(
                f"replica {self.proc.pid} sent no report in {WAIT_S} s (exit code {self.proc.exitcode})"
            )
        return self.conn.recv()

    def close(self) -> None:
        if self.conn.closed:
            return
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(WAIT_S)
        self.proc.close()
        self.conn.close()


def _held() -> tuple[int, int, int]:
    """(open file descriptors, native threads, Python threads) of this process, once let-go generations have
    closed. Native threads are gloo's (OS threads less Python's); the event loop's executor workers, which
    `asyncio.to_thread` starts up to a fixed number, are not counted."""
    deadline = time.monotonic() + SETTLE_S
    while any(t.name.endswith("-close") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    gc.collect()
    time.sleep(0.2)
    python = threading.enumerate()
    native = len(os.listdir("/proc/self/task")) - len(python)
    return len(os.listdir("/proc/self/fd")), native, sum(not t.name.startswith("asyncio_") for t in python)


async def _replacements(spec: WeightGroupSpec, ctx: Any, replicas: list[_Replica]) -> list[tuple[int, int, int]]:
    """Form the first generation and send v1; then replace the replica `REPLACEMENTS` times. The counts
    after the first send, then after each replacement's first send."""
    version = 1
    publisher = WeightPublisher(spec, 1 << 20, lambda message: None)

    def snapshot() -> tuple[int, list[tuple[str, torch.Tensor]]]:
        return version, _tensors(version)

    replica = _Replica(ctx, spec)
    replicas.append(replica)
    replica.tell(("join", 0, 2), ("receive",))
    await publisher.open(0, snapshot)
    assert replica.report() == ("joined", 0)
    await publisher.publish(snapshot)
    assert replica.report() == ("received", 1, True)
    counts = [_held()]
    generation = 0
    for round_ in range(REPLACEMENTS):
        os.kill(replica.proc.pid, signal.SIGKILL)
        lost = ReformWeightGroup("pi", generation + 1, [], [])
        if round_ % 2:  # lost idle
            publisher.reform(lost)
            await publisher.publish(snapshot)
        else:  # lost under a send: the send fails, and waits for the order that removes the replica
            version += 1
            sending = asyncio.create_task(publisher.publish(snapshot))
            await asyncio.sleep(0.5)
            publisher.reform(lost)
            await asyncio.wait_for(sending, WAIT_S)
        replica.close()
        generation += 3  # the replacement catches up in generation - 1, then joins generation with the others
        replica = _Replica(ctx, spec)
        replicas.append(replica)
        replica.tell(("join", generation - 1, 2), ("receive",), ("join", generation, 2), ("receive",))
        publisher.reform(ReformWeightGroup("pi", generation, [0], [0]))
        version += 1
        await asyncio.wait_for(publisher.publish(snapshot), WAIT_S)
        reports = [replica.report() for _ in range(4)]
        assert reports[1] == ("received", version, True) and reports[3] == ("received", version, True), reports
        counts.append(_held())
    return counts


def test_replacing_a_replica_again_and_again_leaves_the_trainer_what_it_held() -> None:
    """After the first send and after each of 8 replacements (half of the replicas lost under a send; a leak of one file a replacement fails by the second), the
    trainer's process holds the same file descriptors and threads: no generation is left open."""
    ctx = preloaded_processes.context()
    spec = WeightGroupSpec("pi", "gloo", "127.0.0.1", free_ports("127.0.0.1", 1)[0], 2, timeout_s=WAIT_S,
                           first_join_timeout_s=WAIT_S)  # fmt: skip
    replicas: list[_Replica] = []
    torch.set_num_threads(1)
    try:
        counts = asyncio.run(_replacements(spec, ctx, replicas))
    finally:
        for replica in replicas:
            replica.close()
    print("open fds, native threads, Python threads after the first send and each replacement:", counts)
    start = counts[0]
    for after in counts[1:]:
        assert after[0] <= start[0] + 1 and after[1:] == start[1:], counts
