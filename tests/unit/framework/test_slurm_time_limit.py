"""A SLURM job's launcher stops its run at a checkpoint early enough for the time limit, sized from the
run's measured iterations and checkpoints (`mas_async.launch.slurm_time_limit`), and says so when that is
more than SLURM's warning margin; and its steps never inherit the job's CPUs per task. SLURM's end time
and the clock are fakes; the metrics rows are written as the router writes them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mas_async.config import load_config
from mas_async.launch import slurm_time_limit
from mas_async.launch.engines import slurm as slurm_engine
from mas_async.launch.engines.base import Node
from mas_async.launch.engines.slurm import SlurmEngine
from mas_async.launch.launcher import process_specs
from mas_async.launch.slurm_job import JobRequest, batch_script, signal_margin_s, time_limit_s
from mas_async.launch.slurm_time_limit import STOP_SLACK_S, StopTimes, TimeLimitWatch, job_end_time, stop_times
from mas_async.launch.stop_signal import StopOnSignal
from mas_async.router.stop_request import STOP_REQUEST, stop_requested
from tests.support.paths import ROOT


def _row(iteration: int, rollout: float, step: float | None, checkpoint: float | None = None) -> dict[str, Any]:
    """A metrics row as the router writes it: the step's time includes its trainers' checkpoint."""
    row: dict[str, Any] = {"iteration": iteration, "time/rollout_s": rollout}
    if step is not None:
        row["time/step_s"] = step + (checkpoint or 0.0)
    if checkpoint is not None:
        row["policy/vertical/checkpoint_s"] = checkpoint
        row["policy/horizontal/checkpoint_s"] = checkpoint / 2
    return row


def _write(run_dir: Path, rows: list[dict[str, Any]]) -> None:
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_stopping_takes_two_iterations_and_a_checkpoint_as_measured() -> None:
    rows = [
        _row(0, 50.0, 10.0),  # 60 s
        _row(1, 40.0, 30.0, checkpoint=70.0),  # 140 s, of which 70 s the checkpoint: 70 s
        _row(2, 60.0, 20.0),  # 80 s: the longest iteration
        _row(1, 45.0, 15.0),  # a resumed start redoes iteration 1: 60 s
        _row(3, 500.0, None),  # the final evaluation: no step, nothing to stop after
    ]
    times = stop_times(rows)
    assert times == StopTimes(iteration_s=80.0, checkpoint_s=70.0)
    assert times.need_s == 2 * 80 + 70
    assert StopTimes(iteration_s=80.0).need_s == 3 * 80  # no checkpoint measured yet: an iteration's worth
    assert stop_times([_row(0, 30.0, None)]) == StopTimes()  # nothing measured


def test_the_launcher_asks_the_run_to_stop_when_the_time_left_is_less_than_stopping_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    now = [1000.0]
    stop = StopOnSignal()
    stop.attach(tmp_path)
    end = 1000.0 + 2000.0
    watch = TimeLimitWatch(tmp_path, stop, signal_before_s=300, end_time=lambda: end, clock=lambda: now[0])
    assert not watch.check()  # no row yet: the signal alone
    _write(tmp_path, [_row(0, 250.0, 50.0), _row(1, 200.0, 100.0, checkpoint=90.0)])  # 300 s iterations
    need = 2 * 300 + 90 + STOP_SLACK_S  # 810 s: more than the 300 s SLURM warns before
    assert not watch.check()
    out = capsys.readouterr().out
    assert f"stopping at a checkpoint takes up to {2 * 300 + 90} s here" in out
    assert f"more than cluster.slurm.signal_before_s=300: the launcher asks the run to stop {need:.0f} s" in out
    now[0] = end - need - 1
    assert not watch.check() and not stop_requested(tmp_path)
    now[0] = end - need + 1
    assert watch.check() and stop.asked and stop_requested(tmp_path)
    request = json.loads((tmp_path / STOP_REQUEST).read_text())
    assert request["why"] == f"the job's time limit is {need - 1:.0f} s away; stopping takes up to {2 * 300 + 90} s"
    out = capsys.readouterr().out
    assert "asking the run to stop at its next checkpoint" in out and out.count("more than") == 0  # warned once


def test_the_warning_names_the_margin_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    watch = TimeLimitWatch(tmp_path, StopOnSignal(), signal_before_s=300, end_time=lambda: None, clock=lambda: 0.0)
    _write(tmp_path, [_row(0, 300.0, 90.0)])
    assert not watch.check() and not watch.check()  # no time limit: never asks
    out = capsys.readouterr().out
    assert out.count("more than cluster.slurm.signal_before_s=300: the launcher asks the run to stop") == 1
    roomy = TimeLimitWatch(tmp_path, StopOnSignal(), signal_before_s=2000, end_time=lambda: None, clock=lambda: 0.0)
    assert not roomy.check() and capsys.readouterr().out == ""  # the margin covers it: nothing to say


def test_the_job_s_end_time_is_slurm_s(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {
        "limited": "JobId=7 JobName=x TimeLimit=00:10:00 StartTime=2030-01-02T03:00:00 EndTime=2030-01-02T03:10:00",
        "unlimited": "JobId=7 TimeLimit=UNLIMITED EndTime=Unknown",
    }
    asked: list[list[str]] = []

    def scontrol(args: list[str], timeout: float) -> str:
        asked.append(args)
        return answers[args[3]]

    monkeypatch.setattr(slurm_time_limit, "slurm_command", scontrol)
    from datetime import datetime

    assert job_end_time("limited", 5.0) == datetime(2030, 1, 2, 3, 10).timestamp()
    assert job_end_time("unlimited", 5.0) is None
    assert asked[0] == ["scontrol", "show", "job", "limited", "--oneliner"]


def test_steps_do_not_inherit_the_job_s_cpus_per_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What sbatch exports for `--cpus-per-task=16` (Slurm 23 and later: also SLURM_TRES_PER_TASK) never
    reaches a step's srun, which asks for its own CPUs."""
    config = load_config(ROOT / "configs/plan_path_tiny_gpu.yaml", ["cluster.engine=slurm"])
    started: list[tuple[list[str], dict[str, str]]] = []

    class Recorded:
        pid = 4242

        def __init__(self, args: list[str], env: dict[str, str], **_: object) -> None:
            started.append((args, env))

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[0-1]")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "16")
    monkeypatch.setenv("SLURM_TRES_PER_TASK", "cpu=16")
    monkeypatch.setattr(slurm_engine, "allocation_nodes", lambda nodelist, timeout: [Node("n0", "10.0.0.1")])
    monkeypatch.setattr(slurm_engine.subprocess, "Popen", Recorded)
    engine = SlurmEngine(config)
    spec = next(s for s in process_specs(config) if s.name == "trainer/vertical")
    engine.start(spec, engine.nodes[0], ["python", "-c", "pass"], {}, tmp_path / "x.log")
    [(args, env)] = started
    assert "--cpus-per-task=4" in args
    assert "SLURM_CPUS_PER_TASK" not in env and "SLURM_TRES_PER_TASK" not in env
    assert env["SLURM_JOB_ID"] == "7"  # (the job itself is still named)


def test_the_default_margin_leaves_room_for_iterations_of_minutes_but_never_half_the_job(tmp_path: Path) -> None:
    config = load_config(ROOT / "configs/plan_path_tiny.yaml")
    assert config.cluster.slurm.signal_before_s == 900
    assert [time_limit_s(t) for t in ("10", "10:30", "2:00:00", "1-0", "1-2:03", "1-2:03:04", None, "UNLIMITED")] == [
        600, 630, 7200, 86400, 93780, 93784, None, None,
    ]  # fmt: skip
    assert signal_margin_s(900, "2:00:00") == 900 and signal_margin_s(900, None) == 900
    # A 10-minute job warned 15 minutes before its end would be warned as it starts, and stop after every step.
    assert signal_margin_s(900, "10:00") == 300
    request = JobRequest(ROOT / "configs/plan_path_tiny.yaml", [], nodes=1, time="10:00")
    script = batch_script(request, config, tmp_path)
    assert "#SBATCH --signal=B:USR1@300\n" in script
    assert "# SIGUSR1 300 s before the time limit: half the job's --time=10:00 (signal_before_s is 900)" in script
