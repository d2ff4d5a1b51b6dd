"""The framework API: everything user code (envs, nodes, workflows, backends) subclasses or names.

User packages (`envs/`, `nodes/`, a user's own) import only from here; the rest of `mas_async` imports
user code only through the registry's "module:Class" lookups, so the arrows point one way.
"""

from mas_async.api.env import SPLITS, Env, ReferencePolicy, check_split, problem_content, step_env
from mas_async.api.node import Node, ParseError
from mas_async.api.priority import PrioritySlots, episode_iteration, episode_ordinal, episode_turn
from mas_async.api.registry import BACKENDS, ENVS, NODES, WORKFLOWS, RegistryError, resolve
from mas_async.api.sandbox import (
    Limits,
    RunCache,
    SandboxResult,
    SandboxUnavailable,
    is_function_test,
    normalise_output,
    require_isolation,
    run_python,
    run_python_sync,
    run_sync,
    run_tests,
    run_tests_on_constant,
)
from mas_async.api.workflow import Candidate, EpisodeContext, Workflow
from mas_async.config import Config, ConfigError, load_config

__all__ = [
    "BACKENDS",
    "ENVS",
    "NODES",
    "SPLITS",
    "WORKFLOWS",
    "Candidate",
    "Config",
    "ConfigError",
    "Env",
    "EpisodeContext",
    "Limits",
    "Node",
    "ParseError",
    "PrioritySlots",
    "ReferencePolicy",
    "RegistryError",
    "RunCache",
    "SandboxResult",
    "SandboxUnavailable",
    "Workflow",
    "check_split",
    "problem_content",
    "episode_iteration",
    "episode_ordinal",
    "episode_turn",
    "is_function_test",
    "load_config",
    "normalise_output",
    "require_isolation",
    "resolve",
    "run_python",
    "run_python_sync",
    "run_sync",
    "run_tests",
    "run_tests_on_constant",
    "step_env",
]
