"""Roles of a training run in which env worker 1 writes its own CURVE secret key to RUN_DIR/leaked.key (mode
0600) before it runs as usual: what a hostile process of the run, or one whose node was taken over, holds.
The fuzz test floods the router with that key (`python -m tests.support.leaky_roles CONFIG [overrides]`
runs `mas-async train` with these roles)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from mas_async.config import Config
from mas_async.deployment import Deployment
from mas_async.launch import roles
from mas_async.runtime.curve import own_secret

LEAKED = "leaked.key"
LEAKER = 1
"""The env worker whose key leaks."""


def env_worker(config: Config, deployment: Deployment, run_dir: Path, *, index: int, policy: str) -> Any:
    if index == LEAKER:
        fd = os.open(run_dir / f"{LEAKED}.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(own_secret())
        os.replace(run_dir / f"{LEAKED}.tmp", run_dir / LEAKED)
    return roles.env_worker(config, deployment, run_dir, index=index, policy=policy)


ROLES = {**roles.ROLES, "env_worker": env_worker}


def main(argv: list[str]) -> int:
    from mas_async.config import load_config
    from mas_async.launch.launcher import launch

    return launch(load_config(argv[0], argv[1:]), mode="train", roles="tests.support.leaky_roles:ROLES")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
