"""SIGUSR1 to the launcher: the run stops at a checkpoint of its own and can be resumed there.

SLURM sends it before a job's time limit (`--signal=B:USR1@N`, docs/slurm.md); anyone may send it to a
`mas-async train` process; a SLURM job's launcher also asks by itself (`ask`) when the time left is less
than stopping at a checkpoint takes, as measured (`mas_async.launch.slurm_time_limit`). The handler only
records the wish as RUN_DIR/stop_request.json, which the router reads before each step
(`mas_async.router.stop_request`); the launcher then sees the router end the run short of its last
iteration and exits with `STOPPED`. A signal that comes before the run directory is
known is kept and written as soon as it is (`attach`), so none is lost while the run is being prepared.
"""

from __future__ import annotations

import signal
from pathlib import Path
from types import FrameType
from typing import Any

from mas_async.router.stop_request import clear_stop_request, request_stop

STOPPED = 75
"""Exit status of a run that stopped at its own checkpoint when asked (EX_TEMPFAIL: try again later)."""


class StopOnSignal:
    """The SIGUSR1 handler of one launcher: installed with `install`, pointed at the run with `attach`."""

    def __init__(self) -> None:
        self.asked = False
        """Whether SIGUSR1 came (or a caller said it had)."""
        self.run_dir: Path | None = None
        self.why = "SIGUSR1"
        """Why the stop was asked (written into the request)."""

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.ask("SIGUSR1")

    def ask(self, why: str) -> None:
        """Ask the run to stop at its next checkpoint (the signal's handler, or the launcher itself: a SLURM
        job's time limit near, `slurm_time_limit`); written at once if the run is known, else by `attach`."""
        self.asked = True
        self.why = why
        if self.run_dir is not None:
            request_stop(self.run_dir, why)

    def install(self) -> Any:
        """Handle SIGUSR1 from now on; the previous handler, for `signal.signal` to restore."""
        return signal.signal(signal.SIGUSR1, self)

    def attach(self, run_dir: Path) -> None:
        """The run in `run_dir` is about to start: clear a request an earlier run left there, and write this
        launcher's if it was asked already."""
        clear_stop_request(run_dir)
        self.run_dir = run_dir
        if self.asked:
            request_stop(run_dir, f"{self.why} (before the run started)")
