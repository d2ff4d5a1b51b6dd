"""`mas-async plot RUN_DIR`: PNG plots of a run's metrics.jsonl, written to RUN_DIR/plots/.

One PNG per view, plus `overview.png` with all of them:

- reward.png: mean candidate reward per agent (training rollouts; held-out evaluation dashed);
- success.png: team success rate of training rollouts (best-of-K) and of the held-out evaluation, with
  each of the env's reference policies on the same held-out problems as a dotted horizontal line
  (eval/baseline/<name>/team_success_rate: a policy under them has learned nothing they do not do);
- progress.png: per agent, the held-out share of moves that the env judged good (eval/progress_rate/...),
  with the best and worst reference policy's as dotted lines;
- throughput.png: rollout tokens per second;
- time.png: seconds per iteration in each phase (rollout, train step, weight sync);
- logprob_diff.png: per policy, the mean absolute difference between the rollout's log-probs and the
  trainer's recompute (log scale): the evidence that inference ran exactly the trainer's weights.

It reads the file as it is, so it works on a run still in progress. matplotlib draws off-screen (Agg
canvas, no display needed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mas_async.metrics import Keys, read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes

PLOTS_DIR = "plots"


class PlotError(ValueError):
    """The run directory has nothing to plot (said in one sentence)."""


@dataclass(frozen=True)
class Line:
    key: str
    label: str
    dashed: bool = False
    color: int | None = None
    """Index into the colour cycle (the train and eval lines of one agent share a colour)."""


@dataclass(frozen=True)
class View:
    name: str
    title: str
    ylabel: str
    lines: tuple[Line, ...]
    log_y: bool = False
    train_only: bool = False
    """Leave out rows without training (the final evaluation pass) from this view."""
    levels: tuple[Line, ...] = ()
    """Horizontal lines: each `key` read from the first row that has it (a baseline, measured once)."""


def views(rows: list[dict[str, Any]]) -> list[View]:
    """The views of a run, with one line per agent or policy found in its rows."""
    keys = {key for row in rows for key in row}
    agents = sorted(k.removeprefix("reward/") for k in keys if k.startswith("reward/"))
    policies = sorted(k.split("/")[1] for k in keys if k.startswith("policy/") and k.endswith("/logprob_abs_diff"))
    reward = [Line(f"reward/{a}", a, color=i) for i, a in enumerate(agents)] + [
        Line(f"eval/reward/{a}", f"{a} (eval)", dashed=True, color=i)
        for i, a in enumerate(agents)
        if f"eval/reward/{a}" in keys
    ]
    baselines = list(dict.fromkeys(name for row in rows for name in Keys.baselines(row)))  # (the env's order)
    # Colours after the run's own lines (C0, C1), in the order the env names its policies.
    success_levels = tuple(
        Line(Keys.baseline(name, "team_success_rate"), f"{name} (baseline)", color=2 + i)
        for i, name in enumerate(baselines)
    )
    progress_agents = sorted(k.removeprefix("eval/progress_rate/") for k in keys if k.startswith("eval/progress_rate/"))
    progress = tuple(
        Line(f"eval/{Keys.progress_rate(a)}", f"{a} (eval)", dashed=True, color=i)
        for i, a in enumerate(progress_agents)
    )
    progress_levels = _extreme_baselines(rows, baselines, progress_agents)
    return [
        View("reward", "Mean reward per agent", "reward", tuple(reward)),
        View(
            "success",
            "Team success rate",
            "success rate",
            (
                Line(Keys.TRAIN_SUCCESS, "train rollouts (best of K)"),
                Line(Keys.EVAL_SUCCESS, "held-out eval (one sample)", dashed=True),
            ),
            levels=success_levels,
        ),
        View(
            "throughput",
            "Rollout throughput",
            "tokens / s",
            (Line(Keys.TOKENS_PER_S, "rollout"),),
            train_only=True,
        ),
        View(
            "time",
            "Time per phase",
            "seconds per iteration",
            (
                Line(Keys.ROLLOUT_S, "rollout"),
                Line(Keys.TRAIN_S, "train step"),
                Line(Keys.WEIGHT_SYNC_S, "weight sync"),
                Line(Keys.STEP_S, "barrier (train, sync, load)", dashed=True),
            ),
            train_only=True,
        ),
        View(
            "logprob_diff",
            "|rollout - trainer| log-prob difference",
            "mean absolute difference",
            tuple(Line(f"policy/{p}/logprob_abs_diff", p) for p in policies),
            log_y=True,
        ),
        View("progress", "Held-out moves judged good", "share of moves", progress, levels=progress_levels),
    ]


def _extreme_baselines(rows: list[dict[str, Any]], baselines: list[str], agents: list[str]) -> tuple[Line, ...]:
    """Per agent, the reference policies with the highest and the lowest held-out progress rate."""
    lines = []
    for i, agent in enumerate(agents):
        key = Keys.progress_rate(agent)
        rates = {name: v for name in baselines if (v := _first(rows, Keys.baseline(name, key))) is not None}
        if not rates:
            continue
        for name in dict.fromkeys((max(rates, key=rates.__getitem__), min(rates, key=rates.__getitem__))):
            lines.append(Line(Keys.baseline(name, key), f"{agent}: {name} (baseline)", color=i))
    return tuple(lines)


def _first(rows: list[dict[str, Any]], key: str) -> float | None:
    """The value of `key` in the first row that has it (a baseline is measured once per run)."""
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and Keys.ITERATION in row:
            xs.append(int(row[Keys.ITERATION]))
            ys.append(float(value))
    return xs, ys


def _draw(ax: Axes, view: View, rows: list[dict[str, Any]]) -> None:
    if view.train_only:
        rows = [row for row in rows if Keys.TRAIN_S in row or Keys.TRAIN_SUCCESS in row]
    drawn = False
    for line in view.lines:
        xs, ys = _series(rows, line.key)
        if view.log_y:  # zeros (exact agreement) cannot be drawn on a log axis
            kept = [(x, y) for x, y in zip(xs, ys, strict=True) if y > 0]
            xs, ys = [x for x, _ in kept], [y for _, y in kept]
        if xs:
            style = "--" if line.dashed else "-"
            color = None if line.color is None else f"C{line.color % 10}"
            marker = "o" if len(xs) < 30 else None
            ax.plot(xs, ys, style, color=color, marker=marker, markersize=3, label=line.label)
            drawn = True
    for line in view.levels:
        level = _first(rows, line.key)
        if level is not None:
            color = None if line.color is None else f"C{line.color % 10}"
            ax.axhline(level, linestyle=":", linewidth=1.2, color=color, label=f"{line.label} {level:.2f}")
            drawn = True
    ax.set_title(view.title)
    ax.set_xlabel("iteration")
    ax.set_ylabel(view.ylabel)
    ax.grid(True, alpha=0.3)
    if view.log_y and drawn:
        ax.set_yscale("log")
    if drawn:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write every view of RUN_DIR/metrics.jsonl as a PNG (and overview.png); return their paths."""
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    out = Path(out_dir) if out_dir is not None else run_dir / PLOTS_DIR
    bench_file = run_dir / "bench.json"
    if bench_file.is_file():  # a `mas-async bench` run: its throughput figures
        from mas_async.throughput.plot import plot_bench

        return plot_bench(bench_file, out)
    if not metrics.is_file():
        raise PlotError(
            f"{run_dir} has no metrics.jsonl nor bench.json: is it a run directory of `mas-async train` or `mas-async bench`?"
        )
    rows = read_metrics(metrics)
    if not rows:
        raise PlotError(f"{metrics} holds no complete row yet")
    out.mkdir(parents=True, exist_ok=True)
    all_views = views(rows)
    paths = []
    for view in all_views:
        fig = Figure(figsize=(6.4, 4.0), layout="constrained")
        _draw(fig.add_subplot(), view, rows)
        path = out / f"{view.name}.png"
        fig.savefig(path, dpi=100)
        paths.append(path)
    fig = Figure(figsize=(15, 8.5), layout="constrained")
    fig.suptitle(f"mas-async run {run_dir}")
    for index, view in enumerate(all_views):
        _draw(fig.add_subplot(2, (len(all_views) + 1) // 2, index + 1), view, rows)
    path = out / "overview.png"
    fig.savefig(path, dpi=90)
    paths.append(path)
    return paths
