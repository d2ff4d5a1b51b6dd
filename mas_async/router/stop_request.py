"""A request to stop a training run at a checkpoint of its own, so that it resumes there: what a SLURM job
does before its time limit (docs/slurm.md), or anyone who sends the launcher SIGUSR1.

The launcher writes RUN_DIR/stop_request.json (`request_stop`); the run directory is on a file system
every node shares. The router looks for it before each step: asked before the step of iteration v, the
trainers step, then save the weights of v + 1 (`TrainStep.checkpoint_after`), the router saves its position
for iteration v + 1, writes the iteration's row and ends the run. A request that arrives during a step is
taken at the next one. During the last training iteration it is ignored: the run is about to finish
anyway (its final evaluation follows). The launcher removes the file when it starts a run.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

STOP_REQUEST = "stop_request.json"


def request_stop(run_dir: Path, why: str) -> None:
    """Ask the run in `run_dir` to stop at its next checkpoint (atomically: the router never reads half)."""
    tmp = run_dir / f".{STOP_REQUEST}.tmp"
    tmp.write_text(json.dumps({"why": why, "at": time.time()}))
    os.replace(tmp, run_dir / STOP_REQUEST)


def stop_requested(run_dir: Path) -> bool:
    return (run_dir / STOP_REQUEST).exists()


def clear_stop_request(run_dir: Path) -> None:
    (run_dir / STOP_REQUEST).unlink(missing_ok=True)
