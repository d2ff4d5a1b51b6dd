"""A failure of the run's own code that restarting the run cannot mend, and the exit status that says so.

A restart from the last checkpoint helps when a process was lost (a crash, a killed node); it only repeats a
failure that the run's code makes every time, such as a workflow program whose bug fails every episode of
an iteration. The router raises `RunFailed` for that; its process exits with `RUN_FAILED_STATUS`, and the
launcher then stops the run at once and shows the cause (the first episode's error and traceback) instead of
restarting it first.
"""

from __future__ import annotations

RUN_FAILED_STATUS = 3
"""The exit status of a process that stopped on a `RunFailed` (1 is any other failure)."""


class RunFailed(RuntimeError):
    """The run cannot go on, and a restart would fail the same way (module docstring)."""
