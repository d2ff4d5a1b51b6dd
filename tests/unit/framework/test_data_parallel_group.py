"""The trainer ranks' group: joining is bounded with a named error, and the step metrics of the ranks
merge into one row."""

from __future__ import annotations

import socket
import time

import pytest

from mas_async.training.data_parallel import DataParallel, RankGroupError, merge_metrics

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run one at a time (make test)


def test_a_rank_whose_peers_never_come_gets_a_named_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(RankGroupError, match="trainer rank 1 of policy 'p' could not join its 2 ranks"):
        DataParallel.join(policy="p", device="cpu", host="127.0.0.1", port=port, rank=1, world_size=2, timeout_s=2)
    assert time.monotonic() - t0 < 30


def test_metrics_of_the_ranks_merge():
    rank0 = {
        "samples": 3,
        "tokens": 30,
        "loss": 0.25,
        "logprob_abs_diff": 1e-6,
        "logprob_abs_diff_max": 2e-6,
        "reward_mean": 1.0,
        "lr": 0.1,
        "grad_norm": 2.0,
        "optimizer_state_bytes": 100,
        "version_mismatch": 0,
    }
    rank1 = {"samples": 1, "tokens": 10, "loss": 0.5, "logprob_abs_diff": 3e-6, "logprob_abs_diff_max": 5e-6,
             "reward_mean": 0.0, "lr": 0.1, "grad_norm": 2.0, "optimizer_state_bytes": 120, "version_mismatch": 1}  # fmt: skip
    merged = merge_metrics([rank0, rank1])
    assert merged["samples"] == 4 and merged["tokens"] == 40 and merged["version_mismatch"] == 1
    assert merged["loss"] == pytest.approx(0.75)  # each rank's part is over the global normaliser
    assert merged["logprob_abs_diff"] == pytest.approx((30e-6 + 30e-6) / 40)
    assert merged["logprob_abs_diff_max"] == 5e-6 and merged["reward_mean"] == pytest.approx(0.75)
    assert merged["lr"] == 0.1 and merged["grad_norm"] == 2.0
    assert merged["optimizer_state_bytes"] == 100 and merged["optimizer_state_bytes_max"] == 120
    assert merged["ranks"] == 2 and (merged["rank_samples_min"], merged["rank_samples_max"]) == (1, 3)


def test_a_figure_only_some_ranks_measured_is_theirs_and_none_is_made_up():
    """A rank without samples measures no entropy nor log-prob difference: the merged figure is the
    others' (token-weighted), and a figure no rank measured stays absent."""
    empty = {"samples": 0, "tokens": 0, "loss": 0.0, "lr": 0.1}
    rank1 = {"samples": 2, "tokens": 10, "loss": 0.5, "lr": 0.1, "entropy": 1.5, "logprob_abs_diff": 2e-6,
             "logprob_abs_diff_max": 4e-6, "grad_norm": 1.0}  # fmt: skip
    rank2 = {"samples": 1, "tokens": 30, "loss": 0.25, "lr": 0.1, "entropy": 0.5, "logprob_abs_diff": 1e-6,
             "logprob_abs_diff_max": 3e-6, "grad_norm": 1.0}  # fmt: skip
    merged = merge_metrics([empty, rank1, rank2])
    assert merged["entropy"] == pytest.approx((1.5 * 10 + 0.5 * 30) / 40)
    assert merged["logprob_abs_diff"] == pytest.approx((2e-6 * 10 + 1e-6 * 30) / 40)
    assert merged["logprob_abs_diff_max"] == 4e-6 and merged["loss"] == pytest.approx(0.75)
    assert "kl" not in merged and "clip_fraction" not in merged
    assert "entropy" not in merge_metrics([empty, dict(empty)])


def test_the_library_gets_a_longer_timeout_and_a_silent_peer_is_the_codes_named_error(monkeypatch):
    """The process group's own timeout (NCCL's watchdog tears the process down) is longer than the code's
    bound, and a collective a peer never joins ends in RankGroupError within that bound."""
    import datetime

    import torch
    import torch.distributed as dist

    from mas_async.training import data_parallel
    from mas_async.weights.group import library_timeout_s

    given = {}
    monkeypatch.setattr(data_parallel, "open_store", lambda *args, **kw: dist.HashStore())
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: given.update(kw, backend=backend))
    group = DataParallel.join(policy="p", device="cpu", host="127.0.0.1", port=1, rank=0, world_size=2, timeout_s=0.5)
    assert given["timeout"] == datetime.timedelta(seconds=library_timeout_s(0.5)) > datetime.timedelta(seconds=0.5)

    class Stuck:  # a collective whose peer never comes
        def is_completed(self) -> bool:
            return False

    monkeypatch.setattr(dist, "all_reduce", lambda tensor, async_op=False: Stuck())
    t0 = time.monotonic()
    with pytest.raises(RankGroupError, match="the sum over 2 ranks failed or exceeded 0.5s"):
        group.sum([1.0], torch.device("cpu"))
    assert time.monotonic() - t0 < 5
