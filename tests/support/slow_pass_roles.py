"""Roles of a training run whose trainer of SLOW_POLICY takes SLOW_S seconds longer over the first compute pass
of iteration SLOW_ITERATION's streamed step (tests/support/slow_pass.py), with env workers that log each
episode they are sent. `python -m tests.support.slow_pass_roles CONFIG [overrides]` runs `mas-async train`
with these roles; imports are inside the factories (the router's process needs no trainer)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mas_async.config import Config
from mas_async.deployment import Deployment
from mas_async.launch import roles

SLOW_POLICY = "vertical"
SLOW_ITERATION = 1
SLOW_S = 10.0
"""Long enough for the test to kill a worker and for the router to withdraw its attempt while the pass runs
(the launcher polls every 0.25 s, the router reads its word each heartbeat: about 1.5 s in all)."""


def trainer(config: Config, deployment: Deployment, run_dir: Path, *, index: int, policy: str) -> Any:
    if policy != SLOW_POLICY:
        return roles.trainer(config, deployment, run_dir, index=index, policy=policy)
    from tests.support.slow_pass import SlowPassTrainer

    roles.seed_torch(config)
    return SlowPassTrainer(config, deployment, policy, run_dir, rank=index)


def env_worker(config: Config, deployment: Deployment, run_dir: Path, *, index: int, policy: str) -> Any:
    from tests.support.slow_pass import LoggingEnvWorker

    return LoggingEnvWorker(config, deployment, index)


ROLES = {**roles.ROLES, "trainer": trainer, "env_worker": env_worker}


def main(argv: list[str]) -> int:
    from mas_async.config import load_config
    from mas_async.launch.launcher import launch

    return launch(load_config(argv[0], argv[1:]), mode="train", roles="tests.support.slow_pass_roles:ROLES")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
