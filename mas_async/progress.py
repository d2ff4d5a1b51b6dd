"""The launcher's live progress display, fed by RUN_DIR/metrics.jsonl.

On a terminal it is a rich live panel (iteration, success, per-agent reward, tokens/s, the on-policy
proof); elsewhere (CI logs, pipes) it prints one plain line per iteration.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from mas_async.config import Config
from mas_async.metrics import read_metrics


def _fmt(value: Any, spec: str = ".3f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


class Progress:
    def __init__(self, config: Config, run_dir: Path) -> None:
        self.cfg = config
        self.path = run_dir / "metrics.jsonl"
        self.rows: list[dict[str, Any]] = []
        self.last_eval: float | None = None
        self.started = time.monotonic()
        self.console = Console()
        self.live: Live | None = None
        self.console.print(f"[bold]mas-async[/] run directory: {run_dir}")
        if self.console.is_terminal:
            self.live = Live(self._table(), console=self.console, refresh_per_second=4)
            self.live.start()

    def update(self) -> None:
        rows = read_metrics(self.path)
        new = rows[len(self.rows) :]
        self.rows = rows
        for row in new:
            if "eval/team_success_rate" in row:
                self.last_eval = row["eval/team_success_rate"]
            if self.live is None:
                print(self._line(row), flush=True)
        if self.live is not None:
            self.live.update(self._table())

    def _line(self, row: dict[str, Any]) -> str:
        parts = [f"iter {row['iteration']:>4}/{self.cfg.run.iterations}"]
        if "team/success_rate" in row:
            parts.append(f"train_success {_fmt(row['team/success_rate'], '.2f')}")
        if "eval/team_success_rate" in row:
            parts.append(f"eval_success {_fmt(row['eval/team_success_rate'], '.2f')}")
        for agent in self.cfg.agents:
            if f"reward/{agent}" in row:
                parts.append(f"r[{agent}] {_fmt(row[f'reward/{agent}'], '+.2f')}")
        parts.append(f"tok/s {_fmt(row.get('throughput/rollout_tokens_per_s'), '.0f')}")
        diffs = [v for k, v in row.items() if k.endswith("/logprob_abs_diff")]
        if diffs:
            parts.append(f"lp_diff {max(diffs):.1e}")
        parts.append(f"{row.get('time/elapsed_s', 0):.0f}s")
        return "  ".join(parts)

    def _table(self) -> Table:
        table = Table(title="mas-async training", show_header=False, expand=False)
        row = self.rows[-1] if self.rows else {}
        elapsed = time.monotonic() - self.started
        table.add_row("iteration", f"{row.get('iteration', '-')} / {self.cfg.run.iterations}")
        table.add_row("elapsed", f"{elapsed:.0f}s")
        table.add_row("train success (best-of-K)", _fmt(row.get("team/success_rate"), ".2f"))
        table.add_row("eval success (held out)", _fmt(self.last_eval, ".2f"))
        for agent in self.cfg.agents:
            table.add_row(f"reward/{agent}", _fmt(row.get(f"reward/{agent}"), "+.3f"))
        table.add_row("rollout tokens/s", _fmt(row.get("throughput/rollout_tokens_per_s"), ".0f"))
        for policy in self.cfg.policies:
            diff = row.get(f"policy/{policy}/logprob_abs_diff")
            mismatch = row.get(f"policy/{policy}/version_mismatch")
            table.add_row(f"{policy}: logprob diff / mismatch", f"{_fmt(diff, '.1e')} / {_fmt(mismatch, 'd')}")
        return table

    def finish(self) -> None:
        self.update()
        if self.live is not None:
            self.live.stop()
            self.live = None
