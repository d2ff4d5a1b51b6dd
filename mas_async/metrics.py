"""Per-iteration metrics: aggregation of episode summaries and the metrics.jsonl writer.

The router owns the only writer: one JSON object per line, one line per iteration, flushed at once so
the launcher's progress display (and a user's `tail -f`) sees it live.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any


class EpisodeStats:
    """Mean of every numeric key over the summaries of one iteration's episodes of one mode."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.episodes = 0
        self.tokens = 0

    def add(self, summary: dict[str, Any]) -> None:
        self.episodes += 1
        self.tokens += int(summary.get("tokens", 0))
        for key, value in summary.items():
            if key == "tokens" or not isinstance(value, (int, float)) or isinstance(value, str):
                continue
            value = float(value)
            if math.isfinite(value):
                self.sums[key] += value
                self.counts[key] += 1

    def means(self) -> dict[str, float]:
        return {key: self.sums[key] / self.counts[key] for key in self.sums}


class MetricsWriter:
    """Appends one JSON object per iteration to RUN_DIR/metrics.jsonl."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a", buffering=1)

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row, sort_keys=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def keep_rows_before(path: Path, iteration: int) -> None:
    """Resuming at `iteration`: the rows of later iterations belong to steps that were never
    checkpointed, so they move to metrics.replaced.jsonl and the run rewrites them (none is repeated)."""
    rows = read_metrics(path)
    kept = [r for r in rows if r.get("iteration", 0) < iteration]
    dropped = [r for r in rows if r.get("iteration", 0) >= iteration]
    if dropped:
        with path.with_name("metrics.replaced.jsonl").open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in dropped)
    tmp = path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    tmp.replace(path)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All complete rows of a metrics.jsonl (a half-written last line is ignored)."""
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
