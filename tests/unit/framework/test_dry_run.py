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


def _rows(out: str) -> dict[str, list[str]]:
    """process name -> the words of its line (role, node, address, device, gpu, what it listens on...)."""
    lines = out.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("process ")))
    table = [line.split() for line in lines[header + 1 :] if not line.startswith(("policy ", "sandbox: "))]
    return {words[0]: words[1:] for words in table}


def test_every_process_is_printed_on_its_node(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, _ = _dry_run(capsys, tmp_path, "train", "configs/plan_path_tiny.yaml", *TWO_NODES)
    assert rc == 0
    rows = _rows(out)
    assert rows["router"][:4] == ["router", "a", "127.0.0.1", "cpu"]
    assert rows["trainer/vertical"][:4] == ["trainer", "a", "127.0.0.1", "cpu"]
    assert rows["trainer/horizontal"][1:3] == ["a", "127.0.0.1"]
    assert rows["inference/vertical/0"][:3] == ["inference", "b", "127.0.0.2"]
    assert rows["inference/horizontal/0"][1:3] == ["b", "127.0.0.2"]
    assert rows["env_worker/0"][:3] == ["env_worker", "a", "127.0.0.1"]
    assert rows["env_worker/1"][1:3] == ["b", "127.0.0.2"]
    assert "weight and rank stores" in " ".join(rows["trainer/vertical"])
    assert "policy vertical: builtin:tiny-char; weights by gloo: its trainer and servers are on the CPU" in out
    assert "sandbox: env plan_path runs no model-written code" in out


def test_under_slurm_outside_a_job_each_gpu_process_is_a_step_of_its_own(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    args = ("train", "configs/plan_path_tiny_gpu.yaml", "cluster.engine=slurm", "--nodes", "3")
    rc, out, _ = _dry_run(capsys, tmp_path, *args)
    assert rc == 0 and "as a job of 3 nodes" in out
    rows = _rows(out)
    assert rows["trainer/vertical"][1] == "node0" and rows["trainer/horizontal"][1] == "node0"
    assert {rows["inference/vertical/0"][1], rows["inference/horizontal/0"][1]} == {"node1", "node2"}
    assert " ".join(rows["inference/vertical/0"]).endswith("1 GPU(s) of its own, 4 CPU(s)")
    assert " ".join(rows["router"]).endswith("taken at start) 1 CPU(s)")
    assert "weights by nccl: no two of its trainer and servers are on one GPU" in out


def test_one_gpu_for_trainer_and_servers_is_cuda_ipc_and_says_why(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc, out, _ = _dry_run(capsys, tmp_path, "train", "configs/plan_path_tiny_gpu.yaml")
    assert rc == 0
    assert "weights by cuda_ipc: its trainer and every server are on one GPU (cuda:0 of node local" in out


def test_a_sandbox_that_cannot_isolate_refuses_as_a_start_would(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mas_async import sandbox

    def unavailable() -> None:
        raise sandbox.SandboxUnavailable("sandbox: bubblewrap is not installed (said by the test)")

    monkeypatch.setattr(sandbox, "require_isolation", unavailable)
    rc, out, err = _dry_run(capsys, tmp_path, "train", "configs/code_tiny.yaml")
    assert rc == 2 and out == ""
    assert "env code runs model-written code, but sandbox: bubblewrap is not installed (said by the test)" in err


def test_an_evaluation_has_no_trainers(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, _ = _dry_run(capsys, tmp_path, "eval", "configs/plan_path_tiny.yaml")
    assert rc == 0
    assert "(evaluation" in out and "trainer/" not in out
    assert "policy horizontal: builtin:tiny-char; no weight sync (no trainer)" in out


def test_a_placement_the_run_would_refuse_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, err = _dry_run(capsys, tmp_path, "train", "configs/plan_path_tiny.yaml", "cluster.weight_backend=cuda_ipc")
    assert rc == 2 and out == ""
    assert err.startswith("mas-async: ") and "cluster.weight_backend=cuda_ipc" in err
