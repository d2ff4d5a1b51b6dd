"""`mas-async train|eval CONFIG --dry-run`: every process of the run and its place are printed, the
decisions that would refuse the run at launch refuse it here, and nothing is started or written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mas_async import placement
from mas_async.launch.cli import main
from mas_async.launch.engines import local
from tests.support.paths import ROOT

QWEN = sorted((ROOT / "configs").glob("*_qwen3_1.7b.yaml"))

TWO_NODES = (
    "cluster.nodes=[{name: a, address: 127.0.0.1}, {name: b, address: 127.0.0.2}]",
    "cluster.placement={inference: b, env_worker/1: b}",
    "cluster.env_workers=2",
)


def _dry_run(capsys: pytest.CaptureFixture[str], tmp_path: Path, *args: str) -> tuple[int, str, str]:
    out_dir = tmp_path / "run"
    # The memory plan is test_memory_plan.py's: at a shipped Qwen3 config's real shape (its model a hub id, whose
    # shape is known) it runs the training step under FakeTensorMode, minutes of CPU across these tests.
    rc = main([*args, f"run.output_dir={out_dir}", "--dry-run", "--no-memory-plan"])
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
    # The GPU steps packed, each policy's trainer beside its server: 2 GPUs on each of 2 nodes, none on the third.
    assert rows["trainer/vertical"][1] == rows["inference/vertical/0"][1] == "node0"
    assert rows["trainer/horizontal"][1] == rows["inference/horizontal/0"][1] == "node1"
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


def _no_cuda_question(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan is for the job's nodes: it never asks whether this machine has CUDA."""

    def asked() -> bool:
        raise AssertionError("the dry run asked this machine whether it has CUDA")

    monkeypatch.setattr(placement, "_cuda_available", asked)


@pytest.mark.parametrize("config", QWEN, ids=lambda path: path.name)
def test_every_qwen_config_on_nodes_of_8_gpus_gives_each_trainer_and_vllm_server_a_gpu_of_its_own(
    config: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_cuda_question(monkeypatch)
    rc, out, err = _dry_run(capsys, tmp_path, "train", str(config), "--gpus-per-node", "8", "--json")
    assert rc == 0, err
    plan = json.loads(out)
    assert plan["gpus_per_node"] == 8 and plan["assumed"] == "planned for nodes of 8 GPUs each (--gpus-per-node)"
    gpu_processes = [p for p in plan["processes"] if p["role"] in ("trainer", "inference")]
    assert len(gpu_processes) == 8 and all(len(p["gpus"]) == 1 for p in gpu_processes)
    held = [(p["node"], gpu) for p in plan["processes"] for gpu in p["gpus"]]
    assert len(held) == len(set(held)), "two processes hold one GPU"
    for p in gpu_processes:
        assert p["cuda_visible_devices"] == str(p["gpus"][0]) and p["share"] is None
        assert p["device"] == ("cuda:0" if p["role"] == "trainer" else None)  # vLLM is handed no device
    assert all(not p["gpus"] for p in plan["processes"] if p["role"] in ("router", "env_worker"))
    assert {(p["role"], p.get("rank"), p.get("replica")) for p in gpu_processes} >= {("trainer", 0, None),
                                                                                    ("inference", None, 2)}  # fmt: skip
    for policy in plan["policies"].values():
        assert policy["backend"] == "vllm"
        assert (policy["weight_backend"], policy["reason"]) == (
            "nccl",
            "no two of its trainer and servers are on one GPU",
        )


def test_a_qwen_config_as_a_slurm_job_of_two_nodes_of_8_gpus(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _no_cuda_question(monkeypatch)
    args = ("train", "configs/plan_path_qwen3_1.7b.yaml", "cluster.engine=slurm", "--gpus-per-node", "8", "--json")
    rc, out, err = _dry_run(capsys, tmp_path, *args)
    assert rc == 0, err
    plan = json.loads(out)
    on = {p["name"]: (p["node"], p["gpus"], p["step"]) for p in plan["processes"]}
    assert on["trainer/tool"] == ("node0", [0], "1 GPU(s) of its own, 4 CPU(s)")
    assert on["inference/plan/2"] == ("node1", [3], "1 GPU(s) of its own, 4 CPU(s)")  # a policy per node
    assert all(p["cuda_visible_devices"] is None for p in plan["processes"])  # SLURM sets each step's
    assert {p["weight_backend"] for p in plan["policies"].values()} == {"nccl"}
    rc, _, err = _dry_run(capsys, tmp_path, *args[:-3], "--nodes", "1", "--gpus-per-node", "4")
    assert rc == 2 and "the processes on node node0 need 8 GPUs of their own" in err
    assert "but it has 4 GPUs; lower policies.<p>.replicas or trainer_ranks, spread them over more nodes" in err


def test_without_gpus_per_node_on_a_machine_without_gpus_the_plan_says_what_it_assumed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A login node: the local engine's machine has no GPU, so the plan is for a node with every GPU its
    processes ask for, and says so (it used to plan gloo from this machine's missing CUDA)."""
    _no_cuda_question(monkeypatch)
    monkeypatch.setattr(local, "machine_gpu_uuids", lambda: [])
    rc, out, _ = _dry_run(capsys, tmp_path, "train", "configs/plan_path_qwen3_1.7b.yaml")
    assert rc == 0
    assert out.splitlines()[1] == (
        "GPUs: this machine has no GPU, so the plan assumes that the node it runs on has every GPU its processes "
        "ask for (vLLM servers on GPUs, not the CPU); --gpus-per-node N plans for nodes of N GPUs"
    )
    assert "policy tool: Qwen/Qwen3-1.7B; weights by nccl: no two of its trainer and servers are on one GPU" in out
    rows = _rows(out)
    assert rows["inference/plan/2"][3:5] == ["(vllm)", "7"] and rows["trainer/plan"][3:5] == ["cuda:0", "4"]
    rc, out, _ = _dry_run(capsys, tmp_path, "train", "configs/plan_path_qwen3_1.7b.yaml", "--json")
    assert json.loads(out)["assumed"].startswith("this machine has no GPU, so the plan assumes")
    rc, out, _ = _dry_run(capsys, tmp_path, "train", "configs/plan_path_tiny.yaml")
    assert rc == 0 and not out.splitlines()[1].startswith("GPUs:")  # a run on the CPU assumes nothing


def test_without_gpus_per_node_on_a_machine_with_gpus_the_plan_is_for_its_gpus(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local, "machine_gpu_uuids", lambda: ["GPU-a", "GPU-b", "GPU-c", "GPU-d"])
    rc, _, err = _dry_run(capsys, tmp_path, "train", "configs/plan_path_qwen3_1.7b.yaml")
    assert rc == 2 and "need 8 GPUs of their own" in err and "but it has 4 GPUs" in err
    overrides = ("policies.tool.replicas=1", "policies.plan.replicas=1")
    rc, out, _ = _dry_run(capsys, tmp_path, "train", "configs/plan_path_qwen3_1.7b.yaml", *overrides)
    assert rc == 0 and out.splitlines()[1] == (
        "GPUs: planned for this machine's 4 GPUs (--gpus-per-node N plans for nodes of N GPUs instead)"
    )
    assert _rows(out)["inference/plan/0"][5] == "GPU-d"  # this machine's GPUs by UUID


def test_gpus_per_node_and_json_go_with_the_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "configs/plan_path_tiny.yaml", "--gpus-per-node", "8"])
    assert "--gpus-per-node, --json, --gpu-memory-gib and --no-memory-plan go with --dry-run" in capsys.readouterr().err
