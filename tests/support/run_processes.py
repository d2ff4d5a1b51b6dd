"""Stand-ins for processes of earlier runs: sleeping processes with a run's environment and command line,
for the tests of clearing stale processes (`mas_async.launch.slurm_stale`). Their callers kill them by pid."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mas_async.launch.slurm_stale import JOB_NAME_ENV

MAS_ASYNC_ARGV = ("-m", "mas_async.launch.process", "env_worker", "/runs/earlier")
"""What the command line of a run's process looks like (after `python -c CODE`)."""


def run_process(job_name: str, job_id: str, shm: Path | None = None, argv: tuple[str, ...] = MAS_ASYNC_ARGV):
    """A sleeping process of job `job_id` named `job_name` (holding `shm` mapped), started and ready."""
    code = "import mmap, sys, time\n"
    if shm is not None:
        code += f"f = open({str(shm)!r}, 'r+b'); m = mmap.mmap(f.fileno(), 0)\n"
    code += "print('ready', flush=True); time.sleep(300)"
    env = {**os.environ, JOB_NAME_ENV: job_name, "SLURM_JOB_ID": job_id}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *argv], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc
