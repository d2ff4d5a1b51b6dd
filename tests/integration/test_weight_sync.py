"""Weight broadcast between real processes on loopback: one sender (rank 0) and two receivers.

The children are spawned processes that report through a queue; every test kills whatever is still
alive by pid in a `finally`, and every wait has a timeout, so a failure never hangs the suite.
"""

from __future__ import annotations

import queue
import socket
import time
from typing import Any

import pytest
import torch
from torch import nn

from mas_async import preloaded_processes
from mas_async.inference.backends.base import ThreadedBackend
from mas_async.weights.flat_params import adopt_parameters, flatten_parameters
from mas_async.weights.group import ManifestMismatch, dtype_name, open_weight_group
from mas_async.weights.receiver import WeightReceiver
from mas_async.weights.sender import WeightSender

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


def _flat_sender(port: int, bucket_bytes: int, versions: list[int], out: Any) -> None:
    """As the trainer: persistent parameters, flattened, updated in place between sends."""
    sender = WeightSender(_open(port, 0), bucket_bytes=bucket_bytes)
    params = [(name, nn.Parameter(t, requires_grad=False)) for name, t in _tensors(0)]
    flatten_parameters(params)
    stats = []
    for v in versions:
        with torch.no_grad():
            for (_, p), (_, t) in zip(params, _tensors(v), strict=True):
                p.copy_(t)
        stats.append(sender.send(v, [(name, p.detach()) for name, p in params]))
    out.put(("sender", stats))


class _AdoptingEngine:
    """An engine that takes the received buffers as its parameters (as the transformers backend does);
    `wrong_manifest_at` makes it expect a wrong shape at that update (1-based)."""

    def __init__(self, wrong_manifest_at: int) -> None:
        self.params = {n: nn.Parameter(torch.zeros_like(t), requires_grad=False) for n, t in _tensors(0)}
        self.version = 0
        self.wrong_manifest_at = wrong_manifest_at
        self.updates = 0

    def parameter_manifest(self) -> list[tuple[str, list[int], str]]:
        manifest = _manifest(_tensors(0))
        self.updates += 1
        if self.updates == self.wrong_manifest_at:
            manifest[0] = ("embed.weight", [1, 1], "float32")
        return manifest

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        raise AssertionError("an adopting engine is never asked to copy")

    def adopt_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        adopt_parameters(self.params, named_tensors)


def _adopting_receiver(port: int, rank: int, versions: list[int], out: Any) -> None:
    """Update a ThreadedBackend to each version; report what its parameters hold after each update,
    where they live, and what the previously served tensors hold at that moment."""
    engine = _AdoptingEngine(wrong_manifest_at=2)
    backend = ThreadedBackend(engine)
    backend.receiver = WeightReceiver(_open(port, rank))
    served_before: list[tuple[str, torch.Tensor]] = []
    for version in versions:
        try:
            backend.update_weights(version)
            error = ""
        except ManifestMismatch as e:
            error = str(e)
        raw = [(n, dtype_name(p.dtype), list(p.shape), _bytes(p)) for n, p in engine.params.items()]
        before = [(n, dtype_name(t.dtype), list(t.shape), _bytes(t)) for n, t in served_before]
        ptr = engine.params["embed.weight"].data_ptr()
        out.put((rank, version, {"error": error, "version": engine.version, "raw": raw, "before": before, "ptr": ptr}))
        served_before = [(n, p.data) for n, p in engine.params.items()]


def _bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _run(
    bucket_bytes: int,
    versions: list[int],
    expectations: dict[int, list[Any]],
    sender: Any = _sender,
    receivers: dict[int, Any] | None = None,
) -> list[tuple]:
    """Run one sender and two receivers to completion; return every report (sender's last)."""
    ctx = preloaded_processes.context()
    out = ctx.Queue()
    port = _free_port()
    receivers = receivers or {}
    procs = [ctx.Process(target=sender, args=(port, bucket_bytes, versions, out))]
    procs += [
        ctx.Process(target=receivers.get(rank, _receiver), args=(port, rank, expectations[rank], out))
        for rank in (1, 2)
    ]
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


def test_flattened_parameters_are_sent_without_a_copy_and_the_manifest_only_once() -> None:
    expectations = {1: [None, None, None], 2: [_manifest(_tensors(1))] * 3}
    reports = _run(bucket_bytes=96, versions=[1, 2, 3], expectations=expectations, sender=_flat_sender)
    *received, (_, stats) = reports
    assert sorted((rank, version) for rank, version, _ in received) == [(r, v) for r in (1, 2) for v in (1, 2, 3)]
    for _, version, raw in received:
        _assert_exact(raw, version)
    # One bucket per dtype: each dtype's flat buffer is one region, broadcast as is whatever bucket_bytes says
    # (96 bytes would have cut the float32 tensors into 3 buckets).
    assert [s["buckets"] for s in stats] == [3, 3, 3]
    assert [s["copied_buckets"] for s in stats] == [0, 0, 0]
    assert stats[0]["manifest_bytes"] > 0 and [s["manifest_bytes"] for s in stats[1:]] == [0, 0]
    # The header travels in the headroom in front of the first flat buffer: after the first send (header,
    # manifest, buckets) a version is its buckets' broadcasts and nothing else.
    assert [s["broadcasts"] for s in stats] == [5, 3, 3]


def test_separate_tensors_are_copied_into_buckets() -> None:
    reports = _run(bucket_bytes=96, versions=[1, 2], expectations={1: [None, None], 2: [None, None]})
    stats = reports[-1][1]
    # Only layer.0.weight + layer.0.scale share a bucket without lying back to back; a lone tensor is
    # broadcast as it is.
    assert [s["copied_buckets"] for s in stats] == [1, 1]
    assert stats[1]["manifest_bytes"] == 0  # new tensors, same layout: the manifest is not sent again
    # The first bucket is a lone tensor with no headroom before it: the header is a broadcast of its own.
    assert [s["broadcasts"] for s in stats] == [7, 6]


def _layout_of(version: int) -> tuple[str, list[tuple[str, torch.Tensor]]]:
    """Versions 1..10, two of each layout in turn: flattened (the header in the first bucket's headroom),
    flattened in another order (a new manifest), separate tensors (a lone first tensor: the header
    apart), flattened, and a copied first bucket (the header in the copy buffer)."""
    tensors = _tensors(version)
    layout = (version - 1) // 2
    if layout == 1:
        tensors = tensors[::-1]
    if layout == 4:
        tensors = tensors[2:4] + tensors[:2] + tensors[4:]  # layer.0.weight + scale: one copied bucket
    return ["flat", "flat", "separate", "flat", "copied"][layout], tensors


def _changing_sender(port: int, bucket_bytes: int, versions: list[int], out: Any) -> None:
    sender = WeightSender(_open(port, 0), bucket_bytes=bucket_bytes)
    stats = []
    for v in versions:
        kind, tensors = _layout_of(v)
        if kind == "flat":
            params = [(name, nn.Parameter(t, requires_grad=False)) for name, t in tensors]
            flatten_parameters(params)
            tensors = [(name, p.detach()) for name, p in params]
        stats.append(sender.send(v, tensors))
    out.put(("sender", stats))


def test_the_layout_may_change_between_versions_whichever_way_the_header_travels() -> None:
    """Every change of manifest reaches the receivers whole: from a layout whose first bucket carries the
    header (they expect that bucket first) to another such, to one with the header apart, and back."""
    versions = list(range(1, 11))
    reports = _run(bucket_bytes=96, versions=versions, expectations={1: [None] * 10, 2: [None] * 10},
                   sender=_changing_sender)  # fmt: skip
    *received, (_, stats) = reports
    assert sorted((rank, version) for rank, version, _ in received) == [(r, v) for r in (1, 2) for v in versions]
    for _, version, raw in received:
        sent = {n: t for n, t in _layout_of(version)[1]}
        assert [n for n, *_ in raw] == list(sent), version
        for name, dtype, shape, data in raw:
            assert (dtype, shape) == (dtype_name(sent[name].dtype), list(sent[name].shape)), (version, name)
            assert data == sent[name].reshape(-1).view(torch.uint8).numpy().tobytes(), (version, name)
    assert [s["manifest_bytes"] > 0 for s in stats] == [True, False] * 5
    assert [s["copied_buckets"] > 0 for s in stats[::2]] == [False, False, True, False, True]
    # A new layout: header (apart, or in the previous layout's first bucket) + manifest + buckets. The same
    # layout again: its buckets alone, but for the separate tensors' header.
    assert [s["broadcasts"] - s["buckets"] for s in stats] == [2, 0, 2, 0, 2, 1, 2, 0, 2, 0]


def test_an_adopting_engine_is_updated_without_touching_the_weights_it_serves() -> None:
    versions = [1, 2, 3, 4]
    expectations = {1: versions, 2: [None] * 4}
    reports = _run(
        bucket_bytes=1 << 20,
        versions=versions,
        expectations=expectations,
        sender=_flat_sender,
        receivers={1: _adopting_receiver},
    )
    adopting = {version: report for rank, version, report in reports[:-1] if rank == 1}
    for version, raw in ((v, r) for rank, v, r in reports[:-1] if rank == 2):
        _assert_exact(raw, version)
    # v1 adopted; v2 refused by the engine's manifest; v3, v4 adopted.
    assert [adopting[v]["version"] for v in versions] == [1, 1, 3, 4]
    assert "embed.weight" in adopting[2]["error"] and not any(adopting[v]["error"] for v in (1, 3, 4))
    _assert_exact(adopting[1]["raw"], 1)
    _assert_exact(adopting[2]["raw"], 1)  # the failed update went into the spare buffers
    _assert_exact(adopting[3]["raw"], 3)
    _assert_exact(adopting[4]["raw"], 4)
    # While v4 was received, the v3 weights being served stayed intact: two buffer sets, alternating.
    _assert_exact(adopting[4]["before"], 3)
    _assert_exact(adopting[3]["before"], 1)
    assert adopting[3]["ptr"] != adopting[1]["ptr"] and adopting[4]["ptr"] == adopting[1]["ptr"]


def test_a_rank_whose_store_never_answers_gets_a_named_error():
    """No rank 0 ever listens: rank 1 gives up after its timeout, naming the policy, rank and store."""
    from mas_async.deployment import free_ports
    from mas_async.weights.group import WeightGroupError

    port = free_ports("127.0.0.1", 1)[0]
    with pytest.raises(WeightGroupError, match=rf"rank 1 of policy 'pi'.*store at 127.0.0.1:{port}.*within 2s"):
        open_weight_group(policy="pi", backend="gloo", host="127.0.0.1", port=port, rank=1, world_size=2, timeout_s=2)
