"""The policy against its baselines where a user looks: the end-of-run table (`mas-async train` and
`mas-async eval`), the plain progress lines, and `mas-async plot`'s horizontal lines."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure
from rich.console import Console

from mas_async.config import load_config
from mas_async.launch.comparison import comparison_lines
from mas_async.launch.plot import _draw, plot_run, views
from mas_async.launch.progress import Progress
from mas_async.metrics import Keys
from tests.support.paths import ROOT

BASELINES = {"random": 0.06, "always_U_L": 0.0, "toward_goal": 0.75, "optimal": 0.94}


def _rows() -> list[dict]:
    first = {"iteration": 0, "team/success_rate": 0.5, "eval/team_success_rate": 0.12, "eval/episodes": 64,
             "eval/reward/vertical": -0.3, "eval/progress_rate/vertical": 0.3}  # fmt: skip
    for name, rate in BASELINES.items():
        first[Keys.baseline(name, "team_success_rate")] = rate
        first[Keys.baseline(name, "reward/vertical")] = rate - 0.5
        first[Keys.baseline(name, "progress_rate/vertical")] = rate / 2
    later = {"iteration": 5, "team/success_rate": 0.8, "eval/team_success_rate": 0.41,
             "eval/reward/vertical": 0.2, "eval/progress_rate/vertical": 0.6, "eval/episodes": 64}  # fmt: skip
    return [first, {"iteration": 1, "team/success_rate": 0.6}, later]


def test_the_table_lines_the_last_evaluation_up_against_every_baseline() -> None:
    lines = comparison_lines(_rows(), ["vertical", "horizontal"])
    assert lines[0] == "held-out problems (64 episodes per row):"
    assert lines[1].split() == ["team", "success", "reward", "vertical", "progress", "vertical", "reward", "horizontal"]
    assert lines[2].split() == ["policy", "(iteration", "5)", "0.41", "+0.20", "0.60", "-"]
    assert [line.split()[1] for line in lines[3:]] == list(BASELINES)
    assert lines[5].split()[2:] == ["0.75", "+0.25", "0.38", "-"]
    assert comparison_lines(_rows()[1:], ["vertical"]) == []  # no baselines, no table


def test_plain_progress_prints_the_baselines_once(tmp_path: Path, capsys) -> None:
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", [f"run.output_dir={tmp_path}"])
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    progress = Progress(config, tmp_path)
    progress.update()
    progress.summary()
    out = capsys.readouterr().out
    assert out.count("baselines, held-out team success") == 1  # once, with the row that has them
    assert "baselines, held-out team success: random 0.06  always_U_L 0.00  toward_goal 0.75  optimal 0.94" in out
    assert "baseline optimal" in out and "policy (iteration 5)" in out
    # Every held-out success is printed with the best baseline beside it (ETA on the same line).
    assert "eval_success 0.41 (best baseline optimal 0.94)" in out and "eta " in out
    assert progress.baselines == BASELINES and progress.last_progress == {"vertical": 0.6}
    console = Console(width=200, record=True)
    console.print(progress._table())  # the live panel on a terminal
    panel = console.export_text()
    assert "baselines (held out)" in panel and "optimal 0.94" in panel and "eval progress/vertical" in panel
    assert "0.41 (best baseline optimal 0.94)" in panel and "elapsed / ETA" in panel


def test_the_success_plot_draws_each_baseline_as_a_level(tmp_path: Path) -> None:
    rows = _rows()
    success = next(v for v in views(rows) if v.name == "success")
    assert [line.key for line in success.levels] == [Keys.baseline(n, "team_success_rate") for n in BASELINES]
    fig = Figure()
    ax = fig.add_subplot()
    _draw(ax, success, rows)
    levels = sorted(line.get_ydata()[0] for line in ax.lines if line.get_linestyle() == ":")
    assert levels == sorted(BASELINES.values())
    progress = next(v for v in views(rows) if v.name == "progress")
    assert [line.label for line in progress.levels] == [
        "vertical: optimal (baseline)",
        "vertical: always_U_L (baseline)",
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert (tmp_path / "plots" / "success.png") in plot_run(tmp_path)
