"""A run's problems: the training problems, and the held-out ones that no training problem equals.

Procedural envs draw train and test problems from disjoint seeds, but a small grid can come out of a
train seed and a test seed alike: a held-out figure over such problems measures recall, not
generalisation. So the run holds out the first `env.test_size` test problems whose content (the dict, its
seed aside: `mas_async.api.problem_content`) is not that of any of its `env.train_size` training problems;
a test problem that is a training problem in disguise is skipped and the next one drawn. The router,
`mas-async eval` and `mas-async prompts` all take their problems from here.
"""

from __future__ import annotations

from typing import Any

from mas_async.api import problem_content

MAX_DRAWN = 8
"""Test problems drawn for each held-out one, at most, before the env is taken to have no more."""


class HeldOutError(ValueError):
    """Too few test problems differ from every training problem."""


def run_problems(env_cls: Any, train_size: int, test_size: int, options: dict[str, Any]) -> tuple[list, list]:
    """The run's (train, test) problems: `train_size` of the train split, and the first `test_size` of the
    test split that no training problem equals by content (fewer only when the env's dataset ends first;
    `HeldOutError` when the overlap leaves too few)."""
    train = env_cls.problems("train", train_size, **options)
    seen = {problem_content(p) for p in train}
    drawn = test_size
    while True:
        candidates = env_cls.problems("test", drawn, **options)
        test = [p for p in candidates if problem_content(p) not in seen][:test_size]
        if len(test) == test_size or len(candidates) < drawn or drawn >= MAX_DRAWN * test_size:
            break
        drawn = min(2 * drawn, MAX_DRAWN * test_size)
    dataset_end = len(candidates) < drawn  # a dataset smaller than asked: it holds out what it has
    if not test or (len(test) < test_size and not dataset_end):
        raise HeldOutError(
            f"env {env_cls.__name__}: only {len(test)} of {len(candidates)} test problems differ from every one of "
            f"the env.train_size={train_size} training problems, short of env.test_size={test_size}; lower "
            "env.test_size or env.train_size, or draw from a larger space of problems (env.options)"
        )
    return train, test
