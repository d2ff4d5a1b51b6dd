"""`mas-async train|eval CONFIG --dry-run`: every process of the run and its place are printed, the
decisions that would refuse the run at launch refuse it here, and nothing is started or written."""

from __future__ import annotations

from pathlib import Path

import pytest

from mas_async.launch.cli import main

TWO_NODES = (
    "cluster.nodes=[{name: a, address: 127.0.0.1}, {name: b, address: 127.0.0.2}]",
    "cluster.placement={inference: b, env_worker/1: b}",
    "cluster.env_workers=2",
)


def _dry_run(capsys: pytest.CaptureFixture[str], tmp_path: Path, *args: str) -> tuple[int, str, str]:
    out_dir = tmp_path / "run"
    rc = main([*args, f"run.output_dir={out_dir}", "--dry-run"])
    captured = capsys.readouterr()
    assert not out_dir.exists(), "a dry run wrote its run directory"
    return rc, captured.out, captured.err


def test_every_process_is_printed_on_its_node(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, _ = _dry_run(capsys, tmp_path, "train", "configs/plan_path_tiny.yaml", *TWO_NODES)
    assert rc == 0
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:] if "/" in line.split()[0]}
    assert rows["trainer/vertical"][:3] == ["a", "127.0.0.1", "cpu"]
    assert rows["trainer/horizontal"][:2] == ["a", "127.0.0.1"]
    assert rows["inference/vertical/0"][:2] == ["b", "127.0.0.2"]
    assert rows["inference/horizontal/0"][:2] == ["b", "127.0.0.2"]
    assert rows["env_worker/0"][:2] == ["a", "127.0.0.1"]
    assert rows["env_worker/1"][:2] == ["b", "127.0.0.2"]
    assert any(line.split()[:3] == ["router", "a", "127.0.0.1"] for line in out.splitlines())
    assert "policy vertical: builtin:tiny-char, weights by gloo" in out
    assert "sandbox: env plan_path runs no model-written code" in out


def test_an_evaluation_has_no_trainers(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, _ = _dry_run(capsys, tmp_path, "eval", "configs/plan_path_tiny.yaml")
    assert rc == 0
    assert "(evaluation" in out and "trainer/" not in out
    assert "policy horizontal: builtin:tiny-char, no weight sync (no trainer)" in out


def test_a_placement_the_run_would_refuse_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, err = _dry_run(capsys, tmp_path, "train", "configs/plan_path_tiny.yaml", "cluster.weight_backend=cuda_ipc")
    assert rc == 2 and out == ""
    assert err.startswith("mas-async: ") and "cluster.weight_backend=cuda_ipc" in err
