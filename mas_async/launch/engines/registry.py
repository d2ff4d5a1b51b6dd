"""`cluster.engine` -> the engine that runs the processes: local subprocesses, Ray actors or SLURM steps."""

from __future__ import annotations

import importlib

from mas_async.config import Config
from mas_async.launch.engines.base import Engine

ENGINES = {
    "local": "mas_async.launch.engines.local:LocalEngine",
    "ray": "mas_async.launch.engines.ray:RayEngine",
    "slurm": "mas_async.launch.engines.slurm:SlurmEngine",
}


def open_engine(config: Config) -> Engine:
    module_name, _, attr = ENGINES[config.cluster.engine].partition(":")
    return getattr(importlib.import_module(module_name), attr)(config)
