"""Per-iteration metrics: aggregation of episode summaries and the writer of RUN_DIR/metrics.jsonl,
RUN_DIR/tensorboard/ and, when `metrics.wandb` asks, a Weights & Biases run (mas_async/wandb_run.py).

The router owns the only writer: one JSON object per line, one line per iteration, flushed at once so
the launcher's progress display (and a user's `tail -f`) sees it live. Every numeric value of a row is
also a TensorBoard scalar under the same name, at step = the row's iteration
(`tensorboard --logdir RUN_DIR/tensorboard`), written with tensorboard's own event writer: torch's
SummaryWriter would make the router import torch (~3 s of CPU at every start) for the same file.
The same rows, keys and values go to W&B (`metrics.wandb`), whose package is imported only then.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    from mas_async.wandb_run import WandbRun


class Keys:
    """Names of the metrics that the router writes and the progress display and plots read."""

    ITERATION = "iteration"
    TRAIN_SUCCESS = "team/success_rate"
    TRAIN_EPISODES = "rollout/episodes"
    TRAIN_DROPPED = "rollout/dropped"
    POISONED = "rollout/poisoned"
    """Episodes dropped because they were running on `rollout.max_attempts` lost env workers (also in dropped)."""
    TRAIN_TURNS = "rollout/turns"
    EVAL_SUCCESS = "eval/team_success_rate"
    EVAL_EPISODES = "eval/episodes"
    EVAL_DROPPED = "eval/dropped"
    TOKENS_PER_S = "throughput/rollout_tokens_per_s"
    ROLLOUT_S = "time/rollout_s"
    TRAIN_S = "time/train_s"
    WEIGHT_SYNC_S = "time/weight_sync_s"
    STEP_S = "time/step_s"
    TRAINER_IDLE_S = "time/trainer_idle_s"
    INFERENCE_IDLE_S = "time/inference_idle_s"
    MULTI_VERSION = "rollout/multi_version_token_fraction"
    ELAPSED_S = "time/elapsed_s"
    LATE_GROUPS = "router/late_groups"
    MALFORMED = "router/malformed"
    """Messages the router could not decode so far (dropped; see wire/codec.py)."""
    REFUSED_MESSAGES = "router/refused_messages"
    """Well-formed messages the router dropped so far: from a sender that never joined, of a kind its role
    does not send, or with values the run cannot have (see router/hub.py)."""
    REFUSED_HANDSHAKES = "router/refused_handshakes"
    """ZeroMQ handshakes the router refused so far (a peer without the run's CURVE key; see runtime/handshakes.py)."""
    ROUTED_REQUESTS = "router/routed_requests"
    """Generate requests the router forwarded to a replica in the iteration (with `cluster.leases` only those
    sent while their policy had no live replica leased; see router/leases.py)."""
    LOOP_LAG_P50_MS = "router/loop_lag_p50_ms"
    """How late the router's event loop ran a timer since the previous row, median, in ms: what every message
    waits before the router handles it (router/loop_lag.py)."""
    LOOP_LAG_P99_MS = "router/loop_lag_p99_ms"
    """The same, 99th percentile."""
    LOOP_LAG_MAX_MS = "router/loop_lag_max_ms"
    """The same, the most."""
    LOOP_WORK_LAG_P99_MS = "router/loop_work_lag_p99_ms"
    """Of that lag, the part during which the loop's thread ran (the router's own work, not the time the
    operating system gave other processes), 99th percentile, in ms."""
    LOOP_WORK_LAG_MAX_MS = "router/loop_work_lag_max_ms"
    """The same, the most."""
    LOOP_LAG_TICKS = "router/loop_lag_ticks"
    """How many times the router's loop-lag timer fired since the previous row (the count the row's
    `loop_lag_over` figures are out of)."""
    DIRECT_REQUESTS = "leases/direct_requests"
    """`cluster.leases` only: Generate requests the env workers sent straight to a leased replica, as their
    EpisodeDone messages reported them since the previous row (router/leases.py)."""
    DIRECT_GROUPS = "leases/direct_groups"
    """`cluster.leases` only: episodes' Groups the env workers sent straight to a trainer and the router
    accepted (one per episode and policy) since the previous row (training/direct_groups.py)."""
    STALE_RESULTS = "leases/stale_results"
    """`cluster.leases` only: results the env workers dropped because their request was no longer that
    replica's (it had left the lease and the request went again, or its caller gave up), since the previous row."""
    LOGPROB_DIFF = "logprob_abs_diff"
    VERSION_MISMATCH = "version_mismatch"
    REISSUED_EPISODES = "faults/reissued_episodes"
    """Episodes of a lost env worker that went back to the queue in the iteration (run again from their start)."""
    REISSUED_REQUESTS = "faults/reissued_requests"
    """Generate requests of a lost inference replica sent again to a live one (or held for its replacement): by
    the router, and with `cluster.leases` by the env workers whose lease it left."""
    RECOVERY_S = "faults/recovery_s"
    """The longest recovery completed in the iteration: from a process found dead to its replacement's first
    result (with `cluster.leases`, a replica's: to its replacement leased, serving again)."""

    PARSE_PREFIX = "parse/"
    PROGRESS_PREFIX = "progress_rate/"
    GATEWAY_PREFIX = "gateway/"
    """Per-agent means of an OpenAI API program's calls:
    gateway/calls|in_process|fresh|reused|prefix_mismatch|retokenized/<agent> (docs/gateway.md)."""
    BASELINE_PREFIX = "eval/baseline/"
    GATEWAY_REFUSED_AUTH = "gateway/refused_auth"
    """Requests that the run's external gateways (`gateway.external`) refused in the iteration for a missing or
    wrong run token (401s, docs/gateway.md): the sum of the episode summaries' `refused_auth`."""

    @staticmethod
    def progress_rate(agent: str) -> str:
        """Share of an agent's committed moves that the env judged good (`Env.move_quality`, e.g.
        Plan-Path: the move shortened the distance to the goal), averaged over the iteration's episodes;
        in the row as is (training) and under eval/ (held out). Absent where the env judges no move."""
        return f"progress_rate/{agent}"

    @staticmethod
    def baseline(name: str, key: str) -> str:
        """A reference policy's figure on the held-out problems: eval/baseline/<name>/<key>, with key
        "team_success_rate", "reward/<agent>", "progress_rate/<agent>", "episodes" or "dropped"."""
        return f"eval/baseline/{name}/{key}"

    @staticmethod
    def baselines(row: dict[str, Any], key: str = "team_success_rate") -> dict[str, float]:
        """name -> the row's eval/baseline/<name>/<key> (empty when the row has no baselines)."""
        suffix = "/" + key
        return {
            k[len(Keys.BASELINE_PREFIX) : -len(suffix)]: float(v)
            for k, v in row.items()
            if k.startswith(Keys.BASELINE_PREFIX)
            and k.endswith(suffix)
            and isinstance(v, (int, float))
            and "/" not in k[len(Keys.BASELINE_PREFIX) : -len(suffix)]
        }

    @staticmethod
    def invalid_rate(agent: str) -> str:
        """Fraction of an agent's candidates whose reply did not parse (a ParseError: penalty reward),
        averaged over the iteration's episodes; in the row as is (training) and under eval/ (held out)."""
        return f"parse/invalid_rate/{agent}"

    @staticmethod
    def restarts(role: str) -> str:
        """Restarts of lost `role` processes seen in the iteration (all but an env worker's: of the whole run)."""
        return f"faults/restarts/{role}"

    @staticmethod
    def loop_lag_over(ms: float, work: bool = False) -> str:
        """Of the row's `LOOP_LAG_TICKS`, how many ran over `ms` late (router/loop_lag_over_ms/<ms>), or whose
        lag's own work did (router/loop_work_lag_over_ms/<ms>), for each of router/loop_lag.py's `OVER_MS`:
        rows add up, so a window of rows has its percentiles (`loop_lag.pooled_percentile`)."""
        return f"router/loop_{'work_' if work else ''}lag_over_ms/{ms:g}"

    @staticmethod
    def policy(policy: str, key: str) -> str:
        """A trainer's metric in the row: policy/<policy>/<key>."""
        return f"policy/{policy}/{key}"

    @staticmethod
    def trainer(policy: str, key: str) -> str:
        """How a policy's step overlapped its rollout: trainer/<policy>/compute_s (seconds of the step's
        compute), trainer/<policy>/overlap (the share of them done before the iteration's last group came
        in), trainer/<policy>/tail_s (from that group to the weights sent); a streamed step's
        trainer/<policy>/ready_early and ready_lead_s (what bounded its overlap); training/streaming.py. And
        its precision: trainer/<policy>/changed_fraction (the share of the entries the optimiser holds that
        the step changed; ~0 for a step that moved nothing), with float16 compute loss_scale and
        skipped_steps (docs/gpu.md "Precision")."""
        return f"trainer/{policy}/{key}"


REFUSED_AUTH = "refused_auth"
"""An episode summary's count of the requests its env worker's external gateway refused for their token since
that worker's previous episode (summed, not averaged, into `Keys.GATEWAY_REFUSED_AUTH`)."""

TENSORBOARD_DIR = "tensorboard"
"""Folder of the TensorBoard event files, beside metrics.jsonl."""


class EpisodeStats:
    """Mean of every numeric key over the summaries of one iteration's episodes of one mode."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.episodes = 0
        self.tokens = 0
        self.multi_version_tokens = 0
        """Tokens of episodes whose completions came from more than one weight version."""

    def add(self, summary: dict[str, Any]) -> None:
        self.episodes += 1
        self.tokens += int(summary.get("tokens", 0))
        self.multi_version_tokens += int(summary.get("multi_version_tokens", 0))
        for key, value in summary.items():
            if (
                key in ("tokens", "multi_version_tokens")
                or not isinstance(value, (int, float))
                or isinstance(value, str)
            ):
                continue
            value = float(value)
            if math.isfinite(value):
                self.sums[key] += value
                self.counts[key] += 1

    def means(self) -> dict[str, float]:
        return {key: self.sums[key] / self.counts[key] for key in self.sums}


class MetricsWriter:
    """Appends one JSON object per iteration to RUN_DIR/metrics.jsonl; unless `tensorboard` is False,
    writes its numeric values as scalars to RUN_DIR/tensorboard/; logs it to `wandb` when given."""

    def __init__(self, path: Path, *, tensorboard: bool = True, wandb: WandbRun | None = None) -> None:
        self.path = path
        self._file = path.open("a", buffering=1)
        self._wandb = wandb
        self._board: EventFileWriter | None = None
        if tensorboard:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            self._board = EventFileWriter(str(path.parent / TENSORBOARD_DIR))

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row, sort_keys=False) + "\n")
        self._file.flush()
        if self._board is not None:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary

            scalars = [
                Summary.Value(tag=key, simple_value=float(value))
                for key, value in row.items()
                if key != "iteration" and isinstance(value, (int, float)) and math.isfinite(value)
            ]
            step = int(row.get("iteration", 0))
            self._board.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=scalars)))
            self._board.flush()
        if self._wandb is not None:
            self._wandb.log(row)

    def close(self) -> None:
        self._file.close()
        if self._board is not None:
            self._board.close()
        if self._wandb is not None:
            self._wandb.finish()


def keep_rows_before(path: Path, iteration: int) -> list[dict[str, Any]]:
    """Resuming at `iteration`: the rows of later iterations belong to steps that were never
    checkpointed, so they move to metrics.replaced.jsonl and the run rewrites them (none is repeated).
    Returns the rows moved."""
    rows = read_metrics(path)
    kept = [r for r in rows if r.get("iteration", 0) < iteration]
    dropped = [r for r in rows if r.get("iteration", 0) >= iteration]
    if dropped:
        with path.with_name("metrics.replaced.jsonl").open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in dropped)
    tmp = path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)
    return dropped


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All complete rows of a metrics.jsonl (a half-written last line is ignored)."""
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
