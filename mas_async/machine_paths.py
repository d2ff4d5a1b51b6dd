"""No machine's path in a committed artefact: a path is written as a user names it.

A path inside the repository becomes relative to it (`results/bench/scale-1.json`); any other path (a temp
folder, a run directory, a home) keeps only its last part (`scale-1.json`), after `outside` when the caller
marks such paths (`mas-async results` writes `<machine path>/smollm2`). `mas-async results` and every bench
that saves its arguments or a run's directory (bench/*.py `--json`) write through `without_machine_paths`;
tests/unit/framework/test_bench_paths.py checks that no committed file under results/ holds such a path.

This module imports nothing of the framework, so that any layer and the benches may import it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
"""The repository: the checkout this package is imported from."""
ABSOLUTE = re.compile(r"^(/|~|[A-Za-z]:[\\/])")
"""A string that is an absolute path (POSIX, a home's `~`, or Windows' `C:\\`)."""


def shown_path(path: str | os.PathLike[str], outside: str = "") -> str:
    """`path` as a user names it: relative to the repository when it is inside it (a relative path is taken
    from the current directory), else `outside` followed by its last part."""
    text = os.fspath(path)
    if not re.match(r"^[A-Za-z]:[\\/]", text):  # (a Windows path is never inside this checkout)
        given = Path(text).expanduser()
        for candidate in (Path(os.path.normpath(given.absolute())), given.resolve()):  # (as given; links followed)
            if candidate.is_relative_to(ROOT):
                return candidate.relative_to(ROOT).as_posix()
    return outside + (re.split(r"[\\/]", text.rstrip("/\\"))[-1] or text)


def without_machine_paths(value: Any, outside: str = "") -> Any:
    """`value` (any nesting of dicts, lists and tuples, as saved to JSON or YAML) with every `Path` and every
    string that is an absolute path, a dict's keys included, replaced by `shown_path`. A relative string is
    kept as it is: it names no machine, and it may be no path at all."""
    if isinstance(value, dict):
        return {without_machine_paths(k, outside): without_machine_paths(v, outside) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_machine_paths(item, outside) for item in value]
    if isinstance(value, os.PathLike) or (isinstance(value, str) and ABSOLUTE.match(value)):
        return shown_path(value, outside)
    return value
