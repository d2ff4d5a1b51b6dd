"""`mas-async results RUN_DIR OUT`: a run's evaluation rows (iteration and every eval/ key) and its resolved
config, as the artefacts README.md and docs/ quote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mas_async.launch.cli import main
from mas_async.launch.results import ResultsError, export


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"iteration": 0, "eval/team_success_rate": 0.1, "eval/baseline/random/team_success_rate": 0.3, "loss": 1.0},
        {"iteration": 1, "loss": 0.9},
        {"iteration": 2, "eval/team_success_rate": 0.5, "time/rollout_s": 3.0},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.yaml").write_text("run: {name: x}\n")
    return run


def test_only_the_evaluation_rows_and_their_eval_keys_with_the_config(tmp_path: Path, capsys) -> None:
    run = _run(tmp_path)
    assert main(["results", str(run), str(tmp_path / "out")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "eval.jsonl").read_text().splitlines()]
    assert rows == [
        {"iteration": 0, "eval/baseline/random/team_success_rate": 0.3, "eval/team_success_rate": 0.1},
        {"iteration": 2, "eval/team_success_rate": 0.5},
    ]
    assert (tmp_path / "out" / "config.yaml").read_text() == "run: {name: x}\n"


def test_a_folder_that_is_no_run_is_a_sentence(tmp_path: Path, capsys) -> None:
    with pytest.raises(ResultsError, match="holds no metrics.jsonl"):
        export(tmp_path, tmp_path / "out")
    run = _run(tmp_path)
    (run / "config.yaml").unlink()
    assert main(["results", str(run), str(tmp_path / "out")]) == 2
    assert "holds no config.yaml" in capsys.readouterr().err
