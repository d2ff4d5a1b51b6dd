"""`mas-async results RUN_DIR OUT`: a run's evaluation rows (iteration and every eval/ key), a few columns of
every iteration, its resolved config and its code's commit, as the artefacts README.md and docs/ quote, with
no path of the machine the run came from."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import yaml

from mas_async.launch.cli import main
from mas_async.launch.code_version import code_commit, record_commit
from mas_async.launch.results import NO_COMMIT, ResultsError, export
from tests.support.paths import ROOT


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
    assert yaml.safe_load((tmp_path / "out" / "config.yaml").read_text()) == {"run": {"name": "x"}}


def test_a_folder_that_is_no_run_is_a_sentence(tmp_path: Path, capsys) -> None:
    with pytest.raises(ResultsError, match="holds no metrics.jsonl"):
        export(tmp_path, tmp_path / "out")
    run = _run(tmp_path)
    (run / "config.yaml").unlink()
    assert main(["results", str(run), str(tmp_path / "out")]) == 2
    assert "holds no config.yaml" in capsys.readouterr().err


def _machine_run(tmp_path: Path) -> Path:
    """A run whose config and rows name paths of its machine, with two policies' on-policy figures."""
    run = tmp_path / "machine" / "runs" / "grid_s0"
    run.mkdir(parents=True)
    rows = [
        {"iteration": 0, "time/elapsed_s": 70.0, "time/rollout_s": 68.0, "reward/vertical": -0.5,
         "eval/team_success_rate": 0.11, "eval/note": str(run / "x"), "router/malformed": 0},
        {"iteration": 1, "time/elapsed_s": 90.5, "time/rollout_s": 15.8, "time/step_s": 3.5, "time/train_s": 3.2,
         "time/weight_sync_s": 0.26, "team/success_rate": 0.5, "reward/vertical": 0.25, "reward/horizontal": 0.5,
         "policy/vertical/version_mismatch": 0, "policy/vertical/logprob_abs_diff": 5e-6,
         "policy/vertical/logprob_abs_diff_max": 2.6e-4, "policy/vertical/entropy": 0.7,
         "policy/horizontal/version_mismatch": 0, "policy/vertical/grad_norm": 1.0},
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "run": {"name": "grid", "output_dir": str(run), "seed": 0},
        "policies": {"vertical": {"model": str(tmp_path / "models" / "smollm2")}, "horizontal": {"model": "gguf:x"}},
        "sandbox": {"cgroup_root": "/sys/fs/cgroup/mas"},
        "resume": str(run),
    }
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return run


def test_a_compact_metrics_file_of_every_iteration(tmp_path: Path) -> None:
    written = export(_machine_run(tmp_path), tmp_path / "out")
    assert [p.name for p in written] == ["eval.jsonl", "metrics.csv", "config.yaml", "commit.txt"]
    with (tmp_path / "out" / "metrics.csv").open() as file:
        table = list(csv.DictReader(file))
    assert list(table[0]) == [
        "iteration", "time/elapsed_s", "time/rollout_s", "time/step_s", "time/train_s", "time/weight_sync_s",
        "team/success_rate", "eval/team_success_rate", "reward/horizontal", "reward/vertical",
        "policy/horizontal/version_mismatch", "policy/vertical/entropy", "policy/vertical/logprob_abs_diff",
        "policy/vertical/logprob_abs_diff_max", "policy/vertical/version_mismatch",
    ]  # fmt: skip
    assert table[0]["time/step_s"] == "" and table[0]["eval/team_success_rate"] == "0.11"
    assert float(table[1]["policy/vertical/logprob_abs_diff_max"]) == 2.6e-4
    assert table[1]["policy/vertical/version_mismatch"] == "0" and table[1]["time/weight_sync_s"] == "0.26"


def test_no_path_of_the_machine_is_written(tmp_path: Path) -> None:
    export(_machine_run(tmp_path), tmp_path / "out")
    config = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())
    assert config["run"] == {"name": "grid", "output_dir": None, "seed": 0} and config["resume"] is None
    assert config["policies"]["vertical"]["model"] == "<machine path>/smollm2"  # its last part only
    assert config["policies"]["horizontal"]["model"] == "gguf:x" and config["sandbox"]["cgroup_root"].endswith("/mas")
    for path in (tmp_path / "out").iterdir():
        text = path.read_text()
        assert str(tmp_path) not in text and "/sys/fs" not in text, path.name
    assert json.loads((tmp_path / "out" / "eval.jsonl").read_text().splitlines()[0])["eval/note"] == "<machine path>/x"


def test_the_commit_the_run_recorded_goes_with_it(tmp_path: Path) -> None:
    run = _machine_run(tmp_path)
    export(run, tmp_path / "out")
    assert (tmp_path / "out" / "commit.txt").read_text() == NO_COMMIT  # a run from before commits were recorded
    record_commit(run)
    record_commit(run, resumed_at=4)
    export(run, tmp_path / "out")
    first, resumed = (tmp_path / "out" / "commit.txt").read_text().splitlines()
    assert re.fullmatch(r"[0-9a-f]{40}( with uncommitted changes)?", first)  # this checkout's HEAD
    assert resumed == f"resumed at version 4: {first}" and first == code_commit()


def test_a_launched_run_records_its_commit(tmp_path: Path) -> None:
    from mas_async.config import load_config
    from mas_async.launch.launcher import prepare_run_dir

    config = load_config(ROOT / "configs/plan_path_tiny.yaml", [f"run.output_dir={tmp_path / 'run'}"])
    run_dir = prepare_run_dir(config)
    assert (run_dir / "commit.txt").read_text() == code_commit() + "\n"


def test_the_committed_results_name_no_machine_path() -> None:
    """Every file of every results folder (the benches' own JSON aside)."""
    for folder in sorted((ROOT / "results").iterdir()):
        if folder.name == "bench":
            continue
        for path in folder.iterdir():
            text = path.read_text()
            assert not re.search(r"(^|[\s'\":=])(/work|/tmp|/root|/home)/", text), f"{path.relative_to(ROOT)}"
        assert (folder / "commit.txt").is_file(), folder.name
