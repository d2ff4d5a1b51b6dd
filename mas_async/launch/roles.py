"""The roles of a training deployment: role name -> factory that builds its actor in a process.

A factory takes `(config, deployment, run_dir, index=..., policy=..., **options)` and returns an actor
(something with `run()`). The launcher starts one process per role instance with
`python -m mas_async.launch.process ROLE RUN_DIR --roles MODULE:ATTR`; a benchmark passes its own map
(e.g. `bench.support:ROLLOUT_ROLES`) to the same launcher. Imports are inside the factories: the router
and env workers never import torch, so they start faster.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mas_async.config import Config
from mas_async.deployment import Deployment

RoleFactory = Callable[..., Any]
"""(config, deployment, run_dir, *, index, policy, **options) -> an actor."""


def seed_torch(config: Config) -> None:
    """torch threads and seed of a process that computes (inference servers, trainers)."""
    import torch

    torch.set_num_threads(config.cluster.torch_threads)
    torch.manual_seed(config.run.seed)


def router(config: Config, deployment: Deployment, run_dir: Path, *, index: int, policy: str) -> Any:
    from mas_async.router.hub import Router

    return Router(config, deployment, run_dir)


def env_worker(config: Config, deployment: Deployment, run_dir: Path, *, index: int, policy: str) -> Any:
    from mas_async.rollout.env_worker import EnvWorker

    return EnvWorker(config, deployment, index)


def inference(config: Config, deployment: Deployment, run_dir: Path, *, index: int, policy: str) -> Any:
    seed_torch(config)
    from mas_async.inference.server import InferenceServer

    return InferenceServer(config, deployment, policy, index)


def trainer(config: Config, deployment: Deployment, run_dir: Path, *, index: int, policy: str) -> Any:
    from mas_async.malloc_arenas import TRAINER_ARENAS, cap_malloc_arenas

    cap_malloc_arenas(TRAINER_ARENAS)  # before its threads start (mas_async/malloc_arenas.py)
    seed_torch(config)
    from mas_async.training.trainer import Trainer

    return Trainer(config, deployment, policy, run_dir, rank=index)


ROLES: dict[str, RoleFactory] = {
    "router": router,
    "env_worker": env_worker,
    "inference": inference,
    "trainer": trainer,
}
"""The training deployment's roles (`mas-async train` and `mas-async eval`)."""

DEFAULT_ROLES = "mas_async.launch.roles:ROLES"
