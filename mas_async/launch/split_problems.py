"""The problems a one-process command (`mas-async prompts`, `mas-async episodes`) works on: the first N of a
run's training or held-out split, exactly as the run holds them out (`mas_async.held_out`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mas_async.api.registry import ENVS, resolve
from mas_async.config import ConfigError
from mas_async.held_out import run_problems

if TYPE_CHECKING:
    from mas_async.config import Config


def first_problems(config: Config, count: int, split: str, command: str) -> tuple[Any, list[dict], int]:
    """(the env class, the first `count` problems of `split` ("train" or "test"), the split's size), once
    the config is one that `mas-async <command>` can work on: a workflow of nodes, at least one problem."""
    if config.workflow.program is not None:
        raise ConfigError(
            f"workflow.program={config.workflow.program!r} runs its own agents and writes its own prompts "
            f"(OpenAI API calls); `mas-async {command}` works on a workflow of nodes"
        )
    if count < 1:
        raise ConfigError(f"--n={count}: ask for at least one problem")
    env_cls = resolve(config.env.name, ENVS, "env")
    train, test = run_problems(env_cls, config.env.train_size, config.env.test_size, config.env.options)
    problems = train if split == "train" else test
    return env_cls, problems[:count], len(problems)
