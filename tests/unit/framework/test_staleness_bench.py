"""bench/staleness.py's reading of runs and bench/lockstep.py's burning variant: a mas-async side's window holds
its measured iterations only (the k after it run, unmeasured), sides over repeats are medians, the overlap bound is
lockstep's rollout and step perfectly overlapped; slow programs that burn CPU instead of sleeping, none hanging."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.lockstep import HANG, BurningScriptedEngine, ScriptedEngine, coder_answer
from bench.staleness import median_side, overlap_bound, training_figures

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run one at a time (make test)

POLICY = "shared"


def row(iteration: int, elapsed_s: float, rollout_s: float = 2.0, tokens_per_s: float = 500.0) -> dict:
    """A router's metrics row of the staleness bench's training run (the keys it reads)."""
    trainer = f"trainer/{POLICY}/"
    return {
        "iteration": iteration, "time/elapsed_s": elapsed_s, "time/rollout_s": rollout_s,
        "throughput/rollout_tokens_per_s": tokens_per_s, "rollout/episodes": 8, "rollout/dropped": 0,
        "time/trainer_idle_s": 1.0, "time/inference_idle_s": 0.5, "time/step_s": 1.5,
        "rollout/multi_version_token_fraction": 0.0, trainer + "compute_s": 1.2, trainer + "overlap": 0.5,
        trainer + "tail_s": 0.4,
    }  # fmt: skip


def test_a_sides_window_runs_from_the_last_warm_up_row_to_the_last_measured_one_and_counts_only_their_tokens(
    tmp_path: Path,
) -> None:
    # 2 warm-up iterations, 3 measured, then k = 1 more (unmeasured): its tokens and time are not counted.
    elapsed = [10.0, 14.0, 18.0, 23.0, 27.0, 31.0]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(row(i, t)) for i, t in enumerate(elapsed)) + "\n")
    cpu = SimpleNamespace(row_seen=[100.0 + t for t in elapsed], busy_between=lambda a, b: 1.5 * (b - a))
    config = SimpleNamespace(streams_turns=lambda: False, trainer=SimpleNamespace(tail_threads=None))
    side = training_figures(tmp_path, 2, 3, cpu, 1, config)  # type: ignore[arg-type]
    assert side["step"] == "run" and side["torch_threads"] == 1 and side["measured_iterations"] == 3
    assert "tail_threads" not in side  # (a step without a streamed tail)
    streamed = SimpleNamespace(streams_turns=lambda: True, trainer=SimpleNamespace(tail_threads=2))
    assert training_figures(tmp_path, 2, 3, cpu, 1, streamed)["tail_threads"] == 2  # type: ignore[arg-type]
    assert side["window_s"] == pytest.approx(27.0 - 14.0) and side["cpu_window_s"] == pytest.approx(13.0)
    assert side["tokens"] == 3 * 1000 and side["tokens_per_s"] == pytest.approx(3000 / 13.0)
    assert side["cpu_s"] == pytest.approx(1.5 * 13.0)


def test_a_side_over_repeats_is_the_median_of_each_number_and_keeps_its_runs() -> None:
    runs = [
        {"tokens": 100, "tokens_per_s": 10.0, "step": "run", "streams_turns": True},
        {"tokens": 100, "tokens_per_s": 30.0, "step": "run", "streams_turns": True},
        {"tokens": 100, "tokens_per_s": 20.0, "step": "run", "streams_turns": True},
    ]
    side = median_side(runs)
    assert side["tokens_per_s"] == 20.0 and side["tokens"] == 100 and isinstance(side["tokens"], int)
    assert side["step"] == "run" and side["streams_turns"] is True and side["runs"] == runs


def test_the_overlap_bound_is_locksteps_iteration_over_the_longer_of_its_rollout_and_step() -> None:
    # Lockstep: 10 s iterations of a 6 s rollout and a 4 s step; perfectly overlapped, 6 s: 1.67x.
    lockstep = [{"seconds": 100.0, "iterations": 10, "rollout_s": 6.0, "step_phase_s": 4.0, "torch_threads": 2}]
    bound = overlap_bound({"lockstep": lockstep}, {"k=1": [1.5]})
    assert bound["ratio"] == pytest.approx(10 / 6) and bound["of_bound"]["k=1"] == pytest.approx(1.5 / (10 / 6))
    assert bound["goal"] == 0.9


def test_the_burning_variants_slow_programs_spin_and_none_hangs() -> None:
    problem = {"solution": "def f():\n    return 1\n", "prompt": "def f():\n", "entry_point": "f"}
    sleeping = [coder_answer(problem, random.Random(seed)) for seed in range(400)]
    burning = [coder_answer(problem, random.Random(seed), burn=True) for seed in range(400)]
    assert {kind for kind, _ in sleeping} == {"correct", "wrong", "slow", "hang"}
    assert {kind for kind, _ in burning} == {"correct", "wrong", "slow"}
    for (kind, text), (burnt, program) in zip(sleeping, burning, strict=True):
        if kind in ("slow", "hang"):  # the same draws: a hang becomes a slow program, a sleep a spin
            assert burnt == "slow" and "time.sleep" not in program and HANG not in program
            assert "while time.perf_counter() < _until" in program
        else:
            assert (burnt, program) == (kind, text)
    assert BurningScriptedEngine.burn and not ScriptedEngine.burn
