"""The rollout-only deployment the benchmark scripts build on, re-exported from the framework
(`mas_async.throughput`: the same one `mas-async bench` measures)."""

from mas_async.throughput.actors import (
    BENCH_DIR,
    RecordingEnvWorker,
    RolloutRouter,
    TimedInferenceServer,
    bench_dir,
)
from mas_async.throughput.run import load_record, prepare_rollout, run_rollout, start_rollout

__all__ = [
    "BENCH_DIR",
    "RecordingEnvWorker",
    "RolloutRouter",
    "TimedInferenceServer",
    "bench_dir",
    "load_record",
    "prepare_rollout",
    "run_rollout",
    "start_rollout",
]
