"""Weight broadcast between real processes on loopback: one sender (rank 0) and two receivers.

The children are spawned processes that report through a queue; every test kills whatever is still
alive by pid in a `finally`, and every wait has a timeout, so a failure never hangs the suite.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
from typing import Any

import pytest
import torch

from mas_async.weight_sync import (
    ManifestMismatch,
    WeightReceiver,
    WeightSender,
    dtype_name,
    open_weight_group,
)

WAIT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tensors(version: int) -> list[tuple[str, torch.Tensor]]:
    """Deterministic weights of a given version, in three dtypes."""
    g = torch.Generator().manual_seed(version)
    return [
        ("embed.weight", torch.randn(17, 8, generator=g)),
        ("layer.0.bf16", torch.randn(5, 3, generator=g).to(torch.bfloat16)),
        ("layer.0.weight", torch.randn(4, 4, generator=g)),
        ("layer.0.scale", torch.randn((), generator=g)),
        ("steps", torch.arange(6, dtype=torch.int64) * version),
        ("layer.1.weight", torch.randn(40, generator=g)),
    ]


def _manifest(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, list[int], str]]:
    return [(name, list(t.shape), dtype_name(t.dtype)) for name, t in tensors]


def _open(port: int, rank: int) -> Any:
    torch.set_num_threads(1)
    return open_weight_group(
        policy="pi", backend="gloo", host="127.0.0.1", port=port, rank=rank, world_size=3, timeout_s=WAIT_S
    )


def _sender(port: int, bucket_bytes: int, versions: list[int], out: Any) -> None:
    sender = WeightSender(_open(port, 0), bucket_bytes=bucket_bytes)
    stats = [sender.send(v, _tensors(v)) for v in versions]
    out.put(("sender", stats))


def _receiver(port: int, rank: int, expectations: list[Any], out: Any) -> None:
    receiver = WeightReceiver(_open(port, rank))
    for expected in expectations:
        try:
            version, tensors = receiver.receive(expected)
        except ManifestMismatch as e:
            out.put((rank, "mismatch", str(e)))
            continue
        raw = [
            (n, dtype_name(t.dtype), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
            for n, t in tensors
        ]
        out.put((rank, version, raw))


def _run(bucket_bytes: int, versions: list[int], expectations: dict[int, list[Any]]) -> list[tuple]:
    """Run one sender and two receivers to completion; return every report (sender's last)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_sender, args=(port, bucket_bytes, versions, out))]
    procs += [ctx.Process(target=_receiver, args=(port, rank, expectations[rank], out)) for rank in (1, 2)]
    reports = []
    try:
        for p in procs:
            p.start()
        expected_reports = 1 + sum(len(e) for e in expectations.values())
        deadline = time.monotonic() + WAIT_S
        while len(reports) < expected_reports:
            try:
                reports.append(out.get(timeout=0.5))
            except queue.Empty:
                crashed = [(p.pid, p.exitcode) for p in procs if p.exitcode not in (None, 0)]
                if crashed or time.monotonic() > deadline:
                    pytest.fail(
                        f"weight sync failed (crashed children: {crashed}); reports: {[r[:2] for r in reports]}"
                    )
        for p in procs:
            p.join(timeout=WAIT_S)
            assert p.exitcode == 0, f"child {p.pid} exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return sorted(reports, key=lambda r: r[0] == "sender")


def _assert_exact(raw: list, version: int) -> None:
    sent = _tensors(version)
    assert [n for n, *_ in raw] == [n for n, _ in sent]
    for (name, dtype, shape, data), (_, tensor) in zip(raw, sent, strict=True):
        assert (dtype, shape) == (dtype_name(tensor.dtype), list(tensor.shape)), name
        assert data == tensor.reshape(-1).view(torch.uint8).numpy().tobytes(), name


def test_two_receivers_get_two_versions_exactly_over_many_buckets() -> None:
    expectations = {1: [None, _manifest(_tensors(2))], 2: [_manifest(_tensors(1)), None]}
    reports = _run(bucket_bytes=96, versions=[1, 2], expectations=expectations)
    *received, (_, stats) = reports
    assert sorted((rank, version) for rank, version, _ in received) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for _, version, raw in received:
        _assert_exact(raw, version)
    # 96-byte buckets: embed (544 bytes, alone), bf16, layer.0.weight + scale (68), steps, layer.1 (160).
    assert [s["buckets"] for s in stats] == [5, 5]
    assert stats[0]["bytes"] == sum(t.numel() * t.element_size() for _, t in _tensors(1))


def test_manifest_mismatch_raises_in_the_receiver_without_hanging_the_sender() -> None:
    wrong = _manifest(_tensors(5))
    wrong[2] = ("layer.0.weight", [2, 8], "float32")
    expectations = {1: [wrong, None], 2: [None, _manifest(_tensors(6))]}
    reports = _run(bucket_bytes=1 << 20, versions=[5, 6], expectations=expectations)
    *received, (sender, stats) = reports
    assert sender == "sender" and len(stats) == 2  # the sender finished both sends
    mismatches = [r for r in received if r[1] == "mismatch"]
    assert len(mismatches) == 1 and mismatches[0][0] == 1
    assert "layer.0.weight" in mismatches[0][2] and "[2, 8]" in mismatches[0][2]
    # The group stays usable: rank 1 got the next version, rank 2 both.
    assert sorted((r[0], r[1]) for r in received if r[1] != "mismatch") == [(1, 6), (2, 5), (2, 6)]
    for _rank, version, raw in received:
        if version != "mismatch":
            _assert_exact(raw, version)


def test_bad_arguments_are_explained() -> None:
    with pytest.raises(ValueError, match="'mpi'"):
        open_weight_group(policy="pi", backend="mpi", host="127.0.0.1", port=1, rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank 3 of 2"):
        open_weight_group(policy="pi", backend="gloo", host="127.0.0.1", port=1, rank=3, world_size=2)
