"""The launcher of a job that `mas-async slurm` wrote: start its run, resume it, or requeue the job.

`python -m mas_async.launch.slurm_batch RUN_DIR` is what the batch script execs on the job's first node,
every time the job starts (a requeued job runs its script again from the top):

1. The run's config is RUN_DIR/config.yaml, copied there at submission: editing the original file
   afterwards changes nothing, and every start of the job runs the same config.
2. If RUN_DIR holds a complete checkpoint, the run resumes from the newest one (`resume=RUN_DIR`; the
   rows of later iterations are redone, so each iteration is in metrics.jsonl once). If it holds none (no
   start yet, or one that stopped before its first checkpoint), the run starts from version 0 there. If
   its newest checkpoint is the last version, the run is done and nothing starts.
3. SIGUSR1 (`--signal=B:USR1@N`, N = `cluster.slurm.signal_before_s`: SLURM's warning before the time
   limit) makes the launcher stop the run at a checkpoint of its own (`stop_signal`); then this requeues
   the job (`scontrol requeue`), whose next start resumes there (2). A signal that came before the run
   started (the script passes on one its shell got as MAS_ASYNC_STOP_REQUESTED=1) requeues at once. The
   launcher also asks the run to stop by itself when the job's time left is less than stopping takes, as
   measured from the run's iterations and checkpoints (`slurm_time_limit`), whatever N is.

Preemption and `scontrol requeue` end the job with SIGTERM instead: the launcher stops every process and
SLURM requeues the job (`--requeue`), whose next start resumes from the newest checkpoint there is (2).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mas_async.api.registry import RegistryError
from mas_async.checkpoint import latest_complete
from mas_async.config import ConfigError, load_config
from mas_async.gguf_import import GGUFImportError
from mas_async.launch.engines.base import EngineError
from mas_async.launch.engines.slurm import SlurmCommandError, slurm_command
from mas_async.launch.launcher import launch
from mas_async.launch.slurm_time_limit import watch_job
from mas_async.launch.stop_signal import STOPPED, StopOnSignal

STOP_ENV = "MAS_ASYNC_STOP_REQUESTED"
"""Set to 1 by the batch script when its shell got SIGUSR1 before it exec'd this module."""
REQUEUE_TIMEOUT_S = 60.0


def start_or_resume(run_dir: Path, stop: StopOnSignal) -> int:
    """Steps 1-3 of the module docstring; the exit status."""
    config = load_config(run_dir / "config.yaml")
    version = latest_complete(run_dir, list(config.policies))
    if version is not None and version >= config.run.iterations:
        print(f"mas-async: the run in {run_dir} has finished its {config.run.iterations} iterations already")
        return 0
    if stop.asked:
        print("mas-async: asked to stop (SIGUSR1) before the run started")
        return requeue()
    if version is not None:
        config.resume = str(run_dir)
    job = os.environ.get("SLURM_JOB_ID", "")
    slurm = config.cluster.slurm
    watch = watch_job(run_dir, stop, slurm.signal_before_s, job, slurm.command_timeout_s) if job else None
    try:
        rc = launch(config, again=version is None, stop=stop)
    finally:
        if watch is not None:
            watch.close()
    return requeue() if rc == STOPPED else rc


def requeue() -> int:
    """Put this job back in the queue (it ends now and starts again from its script's top)."""
    job = os.environ.get("SLURM_JOB_ID", "")
    print(f"mas-async: requeueing job {job}; its next start resumes the run", flush=True)
    try:
        slurm_command(["scontrol", "requeue", job], REQUEUE_TIMEOUT_S)
    except SlurmCommandError as e:
        print(f"mas-async: {e}; submit the job's script again to resume the run", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    stop = StopOnSignal()
    stop.install()  # first: from here on no SIGUSR1 is lost
    if os.environ.pop(STOP_ENV, "") == "1":
        stop.asked = True
    parser = argparse.ArgumentParser(prog="python -m mas_async.launch.slurm_batch", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="the run directory that `mas-async slurm` wrote the job's script into")
    args = parser.parse_args(argv)
    try:
        return start_or_resume(Path(args.run_dir).absolute(), stop)
    except (ConfigError, RegistryError, GGUFImportError, EngineError) as e:
        print(f"mas-async: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
