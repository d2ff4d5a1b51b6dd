"""Stop a SLURM run at a checkpoint early enough for its job's time limit, sized from measured times.

A stop request (SIGUSR1, or this module) is taken before the run's next step: the trainers step, save a
checkpoint, and the run ends there, to be resumed by the requeued job (`stop_request.py`, `slurm_batch`). A
request that comes just after a step began waits for the next one, so stopping takes up to two iterations
and a checkpoint. SLURM's warning (`--signal=B:USR1@N`, N = `cluster.slurm.signal_before_s`) comes a fixed
time before the limit; when stopping takes longer, the job would end as TIMEOUT (never requeued) and lose
every iteration since the last periodic checkpoint.

So the batch launcher also watches the run (`TimeLimitWatch`, a thread beside `launch`): from RUN_DIR's
metrics rows it measures the longest iteration (its rollout and step, less its checkpoint) and the longest
checkpoint (`policy/<p>/checkpoint_s`; an iteration's worth until one was measured,
rows of earlier starts of the job included), reads the job's end time (`scontrol show job`, again every
few minutes: a time limit may change), and asks the run to stop itself once the time left is less than two
iterations, a checkpoint and `STOP_SLACK_S`. The stop then comes in time however long an iteration is,
and a TIMEOUT loses at most the iteration in flight. It says so in the job's output when that need is more
than `signal_before_s`. Before the first iterations are measured, the signal alone stops the run.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from mas_async.launch.engines.slurm import SlurmCommandError, slurm_command
from mas_async.launch.stop_signal import StopOnSignal
from mas_async.metrics import Keys

STOP_SLACK_S = 120.0
"""Beyond the measured need: the processes' shutdown and the requeue, and iterations a little slower than
any measured."""
POLL_S = 15.0
"""How often the watch reads the metrics rows and the clock."""
END_TIME_REFRESH_S = 300.0
"""How often the watch asks SLURM for the job's end time again."""
CHECKPOINT_SUFFIX = "/checkpoint_s"
"""A trainer's checkpoint time in a metrics row: `policy/<policy>/checkpoint_s`."""


@dataclass(frozen=True)
class StopTimes:
    """What stopping a run at a checkpoint takes, as measured from its metrics rows."""

    iteration_s: float = 0.0
    """The longest iteration measured, less the checkpoint it saved (0: none measured yet)."""
    checkpoint_s: float | None = None
    """The longest checkpoint measured (None: none yet)."""

    @property
    def need_s(self) -> float:
        """Two iterations and a checkpoint (an iteration's worth while none was measured)."""
        checkpoint = self.iteration_s if self.checkpoint_s is None else self.checkpoint_s
        return 2 * self.iteration_s + checkpoint

    def describe(self) -> str:
        checkpoint = "not measured yet" if self.checkpoint_s is None else f"{self.checkpoint_s:.0f} s"
        return f"iterations of up to {self.iteration_s:.0f} s, a checkpoint {checkpoint}"


def stop_times(rows: list[dict]) -> StopTimes:
    """The longest iteration and checkpoint in `rows` (metrics rows). An iteration's time is its rollout's and
    its step's (`time/rollout_s` + `time/step_s`: with bounded staleness the two overlap, so this errs long),
    less its trainers' longest checkpoint, which the step includes; a row without a step (evaluation only)
    is not an iteration to stop after."""
    longest, checkpoint = 0.0, None
    for row in rows:
        saved = [v for k, v in row.items() if k.startswith("policy/") and k.endswith(CHECKPOINT_SUFFIX)]
        ck = max(saved) if saved else 0.0
        if saved:
            checkpoint = max(checkpoint or 0.0, ck)
        if Keys.STEP_S in row:
            longest = max(longest, row.get(Keys.ROLLOUT_S, 0.0) + row[Keys.STEP_S] - ck)
    return StopTimes(longest, checkpoint)


def read_rows(path: Path) -> list[dict]:
    """The metrics rows of RUN_DIR/metrics.jsonl (none if it is not there yet; a half-written last line is
    left for the next look)."""
    try:
        text = path.read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def job_end_time(job_id: str, timeout_s: float) -> float | None:
    """The job's end time (epoch seconds) as SLURM has it (`scontrol show job`): None without a time limit,
    or when SLURM does not say."""
    out = slurm_command(["scontrol", "show", "job", job_id, "--oneliner"], timeout_s)
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    if fields.get("TimeLimit", "") in ("UNLIMITED", "Partition_Limit"):
        return None
    try:
        return datetime.strptime(fields.get("EndTime", ""), "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


class TimeLimitWatch:
    """The batch launcher's watch on its job's time limit (module docstring): `start` it beside `launch`,
    `close` it after. `end_time` and `clock` stand in for SLURM and the wall clock in tests."""

    def __init__(
        self,
        run_dir: Path,
        stop: StopOnSignal,
        signal_before_s: float,
        end_time: Callable[[], float | None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.metrics = run_dir / "metrics.jsonl"
        self.stop = stop
        self.signal_before_s = signal_before_s
        self.end_time = end_time
        self.clock = clock
        self._end: float | None = None
        self._end_read_at = float("-inf")
        self._warned = False
        self._closed = threading.Event()

    def check(self) -> bool:
        """One look: ask the run to stop if the time left is less than stopping takes. True once asked."""
        if self.stop.asked:
            return True
        times = stop_times(read_rows(self.metrics))
        if times.iteration_s <= 0:
            return False  # nothing measured yet: SLURM's signal alone
        need = times.need_s + STOP_SLACK_S
        if need > self.signal_before_s and not self._warned:
            self._warned = True
            print(
                f"mas-async: stopping at a checkpoint takes up to {times.need_s:.0f} s here ({times.describe()}), "
                f"more than cluster.slurm.signal_before_s={self.signal_before_s:g}: the launcher asks the run to "
                f"stop {need:.0f} s before the job's time limit itself",
                flush=True,
            )
        now = self.clock()
        if now - self._end_read_at >= END_TIME_REFRESH_S:
            self._end, self._end_read_at = self.end_time(), now
        if self._end is None or self._end - now > need:
            return False
        why = f"the job's time limit is {self._end - now:.0f} s away; stopping takes up to {times.need_s:.0f} s"
        print(f"mas-async: {why} ({times.describe()}): asking the run to stop at its next checkpoint", flush=True)
        self.stop.ask(why)
        return True

    def start(self) -> None:
        threading.Thread(target=self._watch, name="slurm-time-limit", daemon=True).start()

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(POLL_S):
            try:
                if self.check():
                    return
            except (OSError, SlurmCommandError) as e:  # the signal still comes; say why this look failed
                print(f"mas-async: the time-limit watch could not look ({e})", flush=True)


def watch_job(
    run_dir: Path, stop: StopOnSignal, signal_before_s: float, job_id: str, timeout_s: float
) -> TimeLimitWatch:
    """A started watch on SLURM job `job_id`."""
    watch = TimeLimitWatch(run_dir, stop, signal_before_s, lambda: job_end_time(job_id, timeout_s))
    watch.start()
    return watch
