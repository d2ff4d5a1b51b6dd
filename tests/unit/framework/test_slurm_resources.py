"""What a SLURM run's steps hold and what its job asks for, without a cluster: the batch script of a GPU
config (per-node GPU and CPU requests, requeue, the warning signal), the srun line of every process (its
own GPUs and CPUs, never `--overlap`), the environment srun runs in, the refusals, and the weight backend
that follows from steps with GPUs of their own. tests/integration/test_slurm.py runs the same on a real
cluster with GPUs declared as GRES."""

from __future__ import annotations

import re

import pytest

from mas_async.config import load_config
from mas_async.launch.cli import main
from mas_async.launch.engines import slurm as slurm_engine
from mas_async.launch.engines.base import Node
from mas_async.launch.engines.slurm import SlurmEngine
from mas_async.launch.launcher import prepare_deployment, process_specs
from mas_async.launch.slurm_resources import JOB_RESOURCE_ENV, StepResources, step_options, step_resources
from tests.support.paths import ROOT

GPU_CONFIG = str(ROOT / "configs/plan_path_tiny_gpu.yaml")  # both policies' trainers and servers on cuda


def _sbatch_lines(text: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH")]


def test_a_gpu_script_asks_every_node_for_its_steps_and_comes_back_after_a_preemption(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = main(
        ["slurm", GPU_CONFIG, "--nodes", "2", "--dry-run", f"run.output_dir={run_dir}",
         "cluster.slurm.signal_before_s=600", "cluster.slurm.cpus={env_worker: 2}"]
    )  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    text = (run_dir / "slurm.sbatch").read_text()
    sbatch = _sbatch_lines(text)
    # node 0: router 1 + a policy's trainer and server 4 + 4 (1 GPU each) + env worker 2 = 11 CPUs, 2 GPUs;
    # node 1: the other policy's 4 + 4 (1 GPU each) + env worker 2 = 10 CPUs, 2 GPUs; the job asks the most of each.
    assert sbatch[2:9] == [
        "--ntasks-per-node=1",
        "--cpus-per-task=11",
        "--gpus-per-node=2",
        "--mem=0",
        "--requeue",
        "--signal=B:USR1@600",
        "--open-mode=append",
    ]
    assert "#   node 0: router (1 CPU), trainer/vertical (4 CPUs, 1 GPU), inference/vertical/0 (4 CPUs, 1 GPU)" in text
    assert "#   node 1: trainer/horizontal (4 CPUs, 1 GPU), inference/horizontal/0 (4 CPUs, 1 GPU)" in text
    assert "--overlap" not in text


def test_each_gpu_process_is_a_step_with_gpus_of_its_own_and_cpu_roles_take_none(tmp_path, monkeypatch):
    """The srun line the engine runs for every process, recorded by a fake Popen."""
    config = load_config(GPU_CONFIG, ["cluster.engine=slurm", "policies.vertical.trainer_ranks=2"])
    started: list[tuple[list[str], dict[str, str]]] = []

    class Recorded:
        pid = 4242

        def __init__(self, args: list[str], env: dict[str, str], **_: object) -> None:
            started.append((args, env))

        def poll(self) -> int | None:
            return None

    engine = _engine(monkeypatch, config, nodes=2)
    monkeypatch.setattr(slurm_engine.subprocess, "Popen", Recorded)
    for name in JOB_RESOURCE_ENV:  # what sbatch exports for --gpus-per-node=2 and friends
        monkeypatch.setenv(name, "2")
    placement = engine.place(process_specs(config))
    for spec in process_specs(config):
        engine.start(spec, placement[spec.name], ["python", "-c", "pass"], {}, tmp_path / "x.log")
    assert len(started) == 8
    by_name = {next(a for a in args if a.startswith("--job-name=")).split("=", 1)[1]: args for args, _ in started}
    for name in ("trainer/vertical", "trainer/vertical/1", "trainer/horizontal", "inference/vertical/0"):
        args = by_name[name]
        assert {"--exact", "--gpus-per-task=1", "--cpus-per-task=4", "--mem=0"} <= set(args), name
        assert "--overlap" not in args and "--gres=none" not in args
    for name in ("router", "env_worker/0", "env_worker/1"):
        args = by_name[name]
        assert {"--exact", "--gres=none", "--cpus-per-task=1", "--mem=0"} <= set(args), name
        assert "--overlap" not in args and not any(a.startswith("--gpus") for a in args)
    assert all("--immediate=60" in args for args in by_name.values())  # no step waits unbounded for resources
    for _, env in started:  # srun would take the job's options as every step's own
        assert not set(JOB_RESOURCE_ENV) & set(env)
    # Each GPU process numbers its own GPUs: its view is its own, a CPU process's is its node's.
    assert engine.gpu_view(process_specs(config)[1], placement["trainer/vertical"]) == "trainer/vertical"
    assert engine.gpu_view(process_specs(config)[0], placement["router"]) == "node0"


def test_a_trainer_and_its_server_on_one_node_sync_over_nccl_not_cuda_ipc(tmp_path, monkeypatch):
    """Both say `cuda` and share a node, but each step holds a GPU of its own: two GPUs, so NCCL."""
    config = load_config(
        GPU_CONFIG, ["cluster.engine=slurm", "cluster.curve=false", "cluster.slurm.placement={inference: 0}"]
    )
    engine = _engine(monkeypatch, config, nodes=1)
    monkeypatch.setattr(engine, "free_ports", lambda node, count: list(range(31000, 31000 + count)))
    deployment = prepare_deployment(config, tmp_path, engine=engine)
    assert deployment.weight_backends == {"vertical": "nccl", "horizontal": "nccl"}
    assert deployment.nodes["trainer/vertical"]["gpu"] == "trainer/vertical/cuda:0"
    assert deployment.nodes["inference/vertical/0"]["gpu"] == "inference/vertical/0/cuda:0"


def test_trainer_ranks_on_slurm_each_see_their_own_gpu_as_cuda_0():
    config = load_config(GPU_CONFIG, ["cluster.engine=slurm", "policies.vertical.trainer_ranks=3"])
    assert [config.trainer_device("vertical", r) for r in range(3)] == ["cuda:0"] * 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["policies.vertical.device=cuda:1"],
         r"trainer/vertical runs on cuda:1, but under cluster.engine=slurm its step holds 1 GPU\(s\) of its own, "
         r"seen as cuda:0..0 \(cluster.slurm.gpus.trainer\)"),
        (["cluster.slurm.gpus={inference: 0}"],
         r"inference/vertical/0 runs on cuda:0, but under cluster.engine=slurm its step holds no GPU"),
        (["cluster.slurm.gpus={trainr: 1}"], r"cluster.slurm.gpus.trainr: not a role or process"),
        (["cluster.slurm.cpus={router: 0}"], r"cluster.slurm.cpus.router"),
    ],
)  # fmt: skip
def test_a_device_the_step_would_not_hold_is_refused_at_submission(tmp_path, capsys, overrides, message):
    rc = main(["slurm", GPU_CONFIG, "--nodes", "2", "--dry-run", f"run.output_dir={tmp_path}", *overrides])
    assert rc == 2
    assert re.search(message, capsys.readouterr().err)


def test_explicit_gpus_and_cpus_per_role_and_process():
    config = load_config(
        GPU_CONFIG,
        ["cluster.engine=slurm", "policies.vertical.device=cuda:1",
         "cluster.slurm.gpus={trainer: 2, inference/horizontal/0: 3}", "cluster.slurm.cpus={trainer/vertical: 16}"],
    )  # fmt: skip
    specs = {s.name: s for s in process_specs(config)}
    assert step_resources(config, specs["trainer/vertical"]) == StepResources(2, 16)  # cuda:1 of its own 2
    assert step_resources(config, specs["trainer/horizontal"]) == StepResources(2, 4)
    assert step_resources(config, specs["inference/horizontal/0"]) == StepResources(3, 4)
    assert step_options(StepResources(2, 16)) == ["--exact", "--cpus-per-task=16", "--gpus-per-task=2", "--mem=0"]
    assert step_options(StepResources(0, 1)) == ["--exact", "--cpus-per-task=1", "--gres=none", "--mem=0"]


def _engine(monkeypatch, config, nodes: int) -> SlurmEngine:
    """A SlurmEngine inside a pretend allocation of `nodes` nodes (no scontrol asked)."""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[0-1]")
    fake = [Node(f"node{i}", "127.0.0.1") for i in range(nodes)]
    monkeypatch.setattr(slurm_engine, "allocation_nodes", lambda nodelist, timeout: fake)
    return SlurmEngine(config)
