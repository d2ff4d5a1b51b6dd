"""Every run an integration test starts writes only documented metrics: at each test's teardown, each key of its
runs' metrics.jsonl rows must be in the metrics reference (mas_async/metrics_reference.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from mas_async.metrics_reference import undocumented
from tests.integration.launch import RUN_DIRS


@pytest.fixture(autouse=True)
def metrics_are_documented() -> Iterator[None]:
    RUN_DIRS.clear()
    yield
    keys: set[str] = set()
    for run_dir in RUN_DIRS:
        for path in run_dir.rglob("metrics.jsonl"):
            for line in path.read_text().splitlines():
                try:
                    keys |= set(json.loads(line))
                except json.JSONDecodeError:  # (a run killed while writing its last row)
                    continue
    RUN_DIRS.clear()
    missing = undocumented(keys)
    assert not missing, f"metrics keys no entry of mas_async/metrics_reference.py documents: {missing}"
