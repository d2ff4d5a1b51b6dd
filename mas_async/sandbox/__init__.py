"""The sandbox: where every program a model wrote runs, isolated by bubblewrap (docs/sandbox.md).

A framework service that envs reach through `mas_async.api` (`run_python`, `run_tests`, `Limits`,
...): `runner.py` runs a program and says how it ended, `tests.py` judges a program against unit
tests outside its process. The rest is how: `bwrap.py` (the boundary), `view.py` (what of the host a
program sees), `seccomp.py` (the filters), `capacity.py` (cgroups, concurrency), `child.py` and
`zygote.py` (the inside), `zygote_client.py` (the warm start).
"""

from mas_async.sandbox.result import Limits, SandboxResult, SandboxUnavailable
from mas_async.sandbox.runner import (
    RunCache,
    configure,
    isolation_available,
    require_isolation,
    run_python,
    run_python_sync,
    run_sync,
)

__all__ = [
    "Limits",
    "RunCache",
    "SandboxResult",
    "SandboxUnavailable",
    "configure",
    "isolation_available",
    "require_isolation",
    "run_python",
    "run_python_sync",
    "run_sync",
]
