"""The launcher's live progress display, fed by RUN_DIR/metrics.jsonl.

On a terminal it is a rich live panel (iteration, elapsed time and ETA, success, per-agent reward,
tokens/s, the on-policy proof, the env's reference policies on the held-out problems); elsewhere (CI
logs, pipes) it prints one plain line per iteration, and the baselines once, when they are in. At the end
of a run, `summary()` prints the last held-out evaluation against the baselines (launch/comparison.py).
The ETA is the remaining training iterations times the mean time per iteration over the last
`ETA_WINDOW` rows (so it follows a run that speeds up or slows down, and averages over evaluations);
after the first iteration, that iteration's own phase times (its elapsed time includes the start-up).

The file is followed from where the last poll stopped (launch/metrics_tail.py), and only what the display
and the summary read is kept: the last row, the last `ETA_WINDOW` + 1 timed rows, the last evaluation and
the first row with baselines. A run of any length costs the launcher the same memory and time per poll.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from mas_async.config import Config
from mas_async.launch.comparison import baselines_line, comparison_lines
from mas_async.launch.metrics_tail import MetricsTail
from mas_async.metrics import Keys
from mas_async.untrained import due_to_say, untrained_policies

ETA_WINDOW = 10
"""Rows (iterations) over which the time per iteration of the ETA is averaged."""
READ_ROWS = 8
"""Rows parsed per read of the file: a long file read again from its start (a resumed run, a whole-run
restart) is parsed a batch at a time, each dropped once taken, so the launcher's memory does not grow with it
(the interpreter keeps a batch's high-water mark: 0.27 MB for 8 of a soak's rows, 1.7 MB for 64)."""


def _fmt(value: Any, spec: str = ".3f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def duration(seconds: float | None) -> str:
    """'45s', '3m12s', '1h02m'; '-' when unknown."""
    if seconds is None:
        return "-"
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _timed(row: dict[str, Any]) -> bool:
    """Does the row say which iteration it ends and when (the rows the ETA is computed from)?"""
    return isinstance(row.get(Keys.ELAPSED_S), (int, float)) and "iteration" in row


def eta_seconds(rows: list[dict[str, Any]], iterations: int) -> float | None:
    """Seconds until the last of `iterations` training iterations is done, from the rows' iteration
    and time/elapsed_s; None before the first row. Only the last `ETA_WINDOW` + 1 timed rows count."""
    timed = [r for r in rows if _timed(r)]
    if not timed:
        return None
    for index in range(len(timed) - 1, 0, -1):  # a resumed run's clock starts again: only its own rows count
        if float(timed[index][Keys.ELAPSED_S]) < float(timed[index - 1][Keys.ELAPSED_S]):
            timed = timed[index:]
            break
    last = timed[-1]
    remaining = iterations - 1 - int(last[Keys.ITERATION])
    if remaining <= 0:
        return 0.0
    first = timed[max(0, len(timed) - 1 - ETA_WINDOW)]
    if first is last:  # one row: its elapsed time includes the start-up, its phase times do not
        phases = [last.get(key) for key in (Keys.ROLLOUT_S, Keys.STEP_S)]
        timed_phases = [float(t) for t in phases if isinstance(t, (int, float))]
        per_iteration = sum(timed_phases) if timed_phases else float(last[Keys.ELAPSED_S])
    else:
        spanned = max(1, int(last[Keys.ITERATION]) - int(first[Keys.ITERATION]))
        per_iteration = (float(last[Keys.ELAPSED_S]) - float(first[Keys.ELAPSED_S])) / spanned
    return remaining * per_iteration


class Progress:
    """One for the launcher's whole run, its whole-run restarts included (`restarted`)."""

    def __init__(self, config: Config, run_dir: Path, start_version: int = 0) -> None:
        self.cfg = config
        self.tail = MetricsTail(run_dir / "metrics.jsonl")
        self.read = 0
        """Rows read from the current file (a rewritten file starts again at 0)."""
        self.print_from = start_version
        """Rows of earlier iterations are taken, not printed: a resumed run's were printed by the run it
        resumes, and so were those a whole-run restart keeps."""
        self.latest: dict[str, Any] = {}
        """The last row read."""
        self.recent: deque[dict[str, Any]] = deque(maxlen=ETA_WINDOW + 1)
        """The last timed rows: all that `eta_seconds` reads."""
        self.baseline_row: dict[str, Any] | None = None
        """The first row with the baselines, and the last evaluation: all that `comparison_lines` reads."""
        self.last_eval_row: dict[str, Any] | None = None
        self.last_eval: float | None = None
        self.last_progress: dict[str, float] = {}
        """agent -> held-out share of moves judged good at the last evaluation."""
        self.baselines: dict[str, float] = {}
        """reference policy -> its held-out team success (measured once per run)."""
        self.started = time.monotonic()
        self.console = Console()
        self.live: Live | None = None
        # Whole on one line, terminal or not (scripts read the path from it).
        self.console.print(f"[bold]mas-async[/] run directory: {run_dir}", soft_wrap=True, highlight=False)
        if self.console.is_terminal:
            self.live = Live(self._table(), console=self.console, refresh_per_second=4)
            self.live.start()

    def restarted(self, start_version: int) -> None:
        """A whole-run restart from the checkpoint of `start_version`: the router rewrites the file with the
        rows before it, and the iterations from it on are run (and printed) again."""
        self.print_from = start_version
        if self.live is None and self.console.is_terminal:
            self.live = Live(self._table(), console=self.console, refresh_per_second=4)
            self.live.start()

    def update(self) -> None:
        """Take the rows written since the last poll, `READ_ROWS` at a time (plain output: print a line for
        each). After a whole-run restart rewrote the file, what was read of the old one is forgotten and the
        new one read from its start."""
        while True:
            rewritten, rows = self.tail.read(READ_ROWS)
            if rewritten:
                self.read = 0
                self._forget()
            for row in rows:
                self.read += 1
                self._take(row)
                if self.live is None and row.get(Keys.ITERATION, self.print_from) >= self.print_from:
                    self._print(row)
            if len(rows) < READ_ROWS:
                break
        if self.live is not None:
            self.live.update(self._table())

    def _print(self, row: dict[str, Any]) -> None:
        print(self._line(row, list(self.recent)), flush=True)
        for policy, why in untrained_policies(row, list(self.cfg.policies)).items():
            if due_to_say(row, policy):
                streak = row.get(f"policy/{policy}/untrained_iterations")
                times = f" ({streak} iterations in a row)" if isinstance(streak, int) and streak > 1 else ""
                print(f"  policy {policy} trained nothing{times}: {why}", flush=True)
        if Keys.baselines(row):
            print(f"  baselines, held-out team success: {baselines_line(row)}", flush=True)

    def _take(self, row: dict[str, Any]) -> None:
        """Keep of `row` what the display and the summary read."""
        self.latest = row
        if _timed(row):
            self.recent.append(row)
        if Keys.EVAL_SUCCESS in row:
            self.last_eval_row = row
            self.last_eval = row[Keys.EVAL_SUCCESS]
            self.last_progress = {
                agent: row[f"eval/{Keys.progress_rate(agent)}"]
                for agent in self.cfg.agents
                if f"eval/{Keys.progress_rate(agent)}" in row
            }
        if Keys.baselines(row):
            self.baselines = Keys.baselines(row)
            if self.baseline_row is None:
                self.baseline_row = row

    def _forget(self) -> None:
        """Drop what was read of a file that a whole-run restart has since rewritten."""
        self.latest, self.baseline_row, self.last_eval_row = {}, None, None
        self.recent.clear()
        self.last_eval, self.last_progress, self.baselines = None, {}, {}

    def note(self, text: str) -> None:
        """A line about the run itself (e.g. a lost process started again), above the live table or
        among the iteration lines."""
        self.console.print(f"mas-async: {text}", markup=False, highlight=False, soft_wrap=True)

    def _line(self, row: dict[str, Any], history: list[dict[str, Any]]) -> str:
        parts = [f"iter {row['iteration']:>4}/{self.cfg.run.iterations}"]
        if Keys.TRAIN_SUCCESS in row:
            parts.append(f"train_success {_fmt(row[Keys.TRAIN_SUCCESS], '.2f')}")
        if Keys.EVAL_SUCCESS in row:
            parts.append(f"eval_success {_fmt(row[Keys.EVAL_SUCCESS], '.2f')}{self._best_baseline()}")
        for agent in self.cfg.agents:
            if f"reward/{agent}" in row:
                parts.append(f"r[{agent}] {_fmt(row[f'reward/{agent}'], '+.2f')}")
        parts.append(f"tok/s {_fmt(row.get(Keys.TOKENS_PER_S), '.0f')}")
        diffs = [v for k, v in row.items() if k.endswith("/logprob_abs_diff")]
        if diffs:
            parts.append(f"lp_diff {max(diffs):.1e}")
        parts.append(f"{row.get(Keys.ELAPSED_S, 0):.0f}s")
        parts.append(f"eta {duration(eta_seconds(history, self.cfg.run.iterations))}")
        return "  ".join(parts)

    def _best_baseline(self) -> str:
        """The best reference policy's held-out success, to read the policy's beside ("" before any)."""
        if not self.baselines:
            return ""
        name = max(self.baselines, key=self.baselines.__getitem__)
        return f" (best baseline {name} {self.baselines[name]:.2f})"

    def _table(self) -> Table:
        table = Table(title="mas-async training", show_header=False, expand=False)
        row = self.latest
        elapsed = time.monotonic() - self.started
        table.add_row(Keys.ITERATION, f"{row.get('iteration', '-')} / {self.cfg.run.iterations}")
        eta = eta_seconds(list(self.recent), self.cfg.run.iterations)
        table.add_row("elapsed / ETA", f"{duration(elapsed)} / {duration(eta)}")
        table.add_row("train success (best-of-K)", _fmt(row.get(Keys.TRAIN_SUCCESS), ".2f"))
        table.add_row("eval success (held out)", _fmt(self.last_eval, ".2f") + self._best_baseline())
        if self.baselines:
            table.add_row("baselines (held out)", "  ".join(f"{n} {v:.2f}" for n, v in self.baselines.items()))
        for agent, rate in self.last_progress.items():
            table.add_row(f"eval progress/{agent}", _fmt(rate, ".2f"))
        for agent in self.cfg.agents:
            table.add_row(f"reward/{agent}", _fmt(row.get(f"reward/{agent}"), "+.3f"))
        table.add_row("rollout tokens/s", _fmt(row.get(Keys.TOKENS_PER_S), ".0f"))
        for policy in self.cfg.policies:
            diff = row.get(Keys.policy(policy, Keys.LOGPROB_DIFF))
            mismatch = row.get(Keys.policy(policy, Keys.VERSION_MISMATCH))
            table.add_row(f"{policy}: logprob diff / mismatch", f"{_fmt(diff, '.1e')} / {_fmt(mismatch, 'd')}")
        for policy, why in untrained_policies(row, list(self.cfg.policies)).items():
            table.add_row(f"[bold red]{policy}: TRAINED NOTHING[/]", why)
        return table

    def summary(self) -> None:
        """The last held-out evaluation against the env's reference policies (when the run has both)."""
        kept = [row for row in (self.baseline_row, self.last_eval_row) if row is not None]
        lines = comparison_lines(kept, list(self.cfg.agents))
        if lines:
            self.console.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)

    def finish(self) -> None:
        self.update()
        if self.live is not None:
            self.live.stop()
            self.live = None
