"""`mas-async slurm` without a cluster: the batch script it writes (--dry-run), its refusals, the engine's
default placement and refusal outside an allocation, and the clearing of stale processes and shared
memory, which must touch nothing of another job name or of a job that still runs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from mas_async.config import ConfigError, load_config
from mas_async.launch.cli import main
from mas_async.launch.engines.base import ProcessSpec
from mas_async.launch.engines.slurm import SlurmEngine
from mas_async.launch.slurm_resources import default_node_index
from mas_async.launch.slurm_stale import clear_stale
from tests.support.paths import ROOT
from tests.support.run_processes import run_process

CONFIG = str(ROOT / "configs/plan_path_tiny.yaml")


def test_dry_run_writes_a_readable_script_and_submits_nothing(tmp_path, capsys, monkeypatch):
    bash = shutil.which("bash")
    monkeypatch.setenv("PATH", "/nonexistent")  # no sbatch reachable: --dry-run must not need it
    run_dir = tmp_path / "run"
    rc = main(
        ["slurm", CONFIG, "--nodes", "2", "--partition", "gpu", "--time", "1:00:00", "--job-name", "pp",
         "--sbatch=--exclusive", "--dry-run", f"run.output_dir={run_dir}", "run.iterations=3"]
    )  # fmt: skip
    assert rc == 0
    script = run_dir / "slurm.sbatch"
    assert capsys.readouterr().out.strip() == str(script)
    text = script.read_text()
    sbatch = [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH")]
    assert sbatch == [
        "--job-name=pp",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=4",  # node 0: router, two trainers, an env worker, one CPU each (no GPU anywhere)
        "--mem=0",
        "--requeue",
        "--signal=B:USR1@900",
        "--open-mode=append",
        f"--chdir={Path.cwd()}",
        f"--output={run_dir}/slurm-%j.out",
        "--partition=gpu",
        "--time=1:00:00",
        "--exclusive",
    ]
    assert "export MAS_ASYNC_JOB_NAME=pp\n" in text
    clear = f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 --job-name=clear-stale {sys.executable} "
    assert clear + "-m mas_async.launch.slurm_stale --job-name pp\n" in text
    assert f"MAS_ASYNC_STOP_REQUESTED=$stop exec {sys.executable} -m mas_async.launch.slurm_batch {run_dir}\n" in text
    assert text.index("slurm_stale") < text.index("slurm_batch")  # clear first, then launch
    assert subprocess.run([bash, "-n", str(script)]).returncode == 0
    assert not (run_dir / "metrics.jsonl").exists()
    # Every start of the job runs the config as it was at submission, with the overrides and on SLURM.
    copied = load_config(run_dir / "config.yaml")
    assert (copied.run.iterations, copied.cluster.engine, copied.run.output_dir) == (3, "slurm", str(run_dir))


def test_refusals_name_the_problem(tmp_path, capsys):
    rc = main(["slurm", CONFIG, "--nodes", "2", "--dry-run", "cluster.slurm.placement.router=2"])
    assert rc == 2
    assert "cluster.slurm.placement names node index 2, but the job has --nodes=2" in capsys.readouterr().err
    rc = main(["slurm", CONFIG, "--nodes", "1", "--dry-run", "cluster.slurm.placement.routr=0"])
    assert rc == 2 and "cluster.slurm.placement.routr: not a role or process" in capsys.readouterr().err
    rc = main(["slurm", CONFIG, "--nodes", "1", "--job-name", "a b", "--dry-run", f"run.output_dir={tmp_path}"])
    assert rc == 2 and "#SBATCH lines cannot hold spaces" in capsys.readouterr().err


def test_the_engine_needs_an_allocation(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ConfigError, match="cluster.engine=slurm runs inside a SLURM allocation"):
        SlurmEngine(load_config(CONFIG, ["cluster.engine=slurm"]))


def test_default_placement_spreads_servers_and_workers():
    def where(role: str, count: int, nodes: int) -> list[int]:
        return [default_node_index(ProcessSpec(f"{role}/{i}", role, ()), i, nodes) for i in range(count)]

    assert where("router", 1, 3) == [0] and where("trainer", 2, 3) == [0, 0]
    assert where("inference", 4, 3) == [1, 2, 1, 2]  # off the trainers' node
    assert where("inference", 2, 1) == [0, 0]
    assert where("env_worker", 4, 3) == [0, 1, 2, 0]


def test_clearing_stops_only_ended_runs_of_the_same_job_name():
    tag = uuid.uuid4().hex[:8]
    job, other_job = f"mas-async-t{tag}", f"mas-async-u{tag}"
    shm = Path("/dev/shm")
    held = shm / f"seg-{tag}-held"  # mapped by a stale process: no job name in its name
    held_other = shm / f"seg-{tag}-other"  # mapped by a process of another job name
    named, named_other = shm / f"{job}.queue", shm / f"{other_job}.queue"
    for path in (held, held_other, named, named_other):
        path.write_bytes(b"\0" * 4096)
    procs = {
        "stale": run_process(job, "101", held),  # an earlier job of this name, ended: cleared
        "other name": run_process(other_job, "101", held_other),  # another job name: untouched
        "this job": run_process(job, "200"),  # the current job's own process: untouched
        "live job": run_process(job, "150"),  # a job of this name that still runs: untouched
        "not mas_async": run_process(job, "101", argv=("-m", "something_else")),  # not a mas_async command
    }
    try:
        cleared = clear_stale(job, "200", active=lambda: {"150", "200"}, grace_s=5.0)
        assert cleared.pids == [procs["stale"].pid]
        assert procs["stale"].wait(timeout=10) is not None
        assert {name for name, p in procs.items() if p.poll() is None} == set(procs) - {"stale"}
        assert sorted(cleared.shm) == sorted([held, named])
        assert not held.exists() and not named.exists() and held_other.exists() and named_other.exists()
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(timeout=10)
        for path in (held, held_other, named, named_other):
            path.unlink(missing_ok=True)
