"""`mas-async plot`: PNGs from a small metrics.jsonl, and a one-sentence error without one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mas_async.launch.cli import main
from mas_async.launch.plot import PlotError, plot_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
VIEWS = ["reward", "success", "throughput", "time", "logprob_diff", "progress", "overview"]


def _write_run(run_dir: Path, iterations: int = 6) -> None:
    rows = []
    for i in range(iterations):
        row = {
            "iteration": i,
            "team/success_rate": i / iterations,
            "reward/vertical": -0.5 + 0.1 * i,
            "reward/horizontal": -0.4 + 0.1 * i,
            "throughput/rollout_tokens_per_s": 900.0 + i,
            "time/rollout_s": 1.5,
            "time/train_s": 0.5,
            "time/weight_sync_s": 0.01,
            "policy/vertical/logprob_abs_diff": 1e-7 * (i + 1),
            "policy/horizontal/logprob_abs_diff": 0.0 if i == 0 else 2e-7,
        }
        if i % 2 == 0:
            row |= {"eval/team_success_rate": i / 10, "eval/reward/vertical": 0.1, "eval/reward/horizontal": 0.2}
        rows.append(row)
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (run_dir / "metrics.jsonl").write_text(text + '{"iteration": 6, "team/succ')  # a half-written last line


def test_plot_writes_every_view(tmp_path: Path) -> None:
    _write_run(tmp_path)
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == [f"{v}.png" for v in VIEWS]
    for path in paths:
        assert path.parent == tmp_path / "plots"
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 5_000


def test_cli_plot_into_another_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_run(tmp_path / "run")
    assert main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "pngs")]) == 0
    assert sorted(p.name for p in (tmp_path / "pngs").iterdir()) == sorted(f"{v}.png" for v in VIEWS)
    assert "wrote 7 plots" in capsys.readouterr().out


def test_missing_metrics_is_one_sentence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(PlotError, match="has no metrics.jsonl"):
        plot_run(tmp_path)
    assert main(["plot", str(tmp_path)]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
