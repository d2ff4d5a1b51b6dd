"""`cluster.engine: slurm` on a real 2-node SLURM cluster on this machine (tests/integration/slurm_cluster.py):
the engine's steps (placement, free ports, pids, graceful and hard stops, a failed step's log) inside an
allocation, and the script of `mas-async slurm` submitted with sbatch, training across both nodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mas_async.config import ConfigError, load_config
from mas_async.launch.engines.base import Node, ProcessSpec
from mas_async.launch.launcher import process_specs
from mas_async.launch.slurm_time_limit import job_end_time
from tests.integration.launch import FAST, ROOT, alive
from tests.integration.slurm_cluster import running_slurm_cluster, skip_reason
from tests.support.run_processes import run_process

pytestmark = [pytest.mark.slurm, pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")]

JOB_TIMEOUT_S = 300.0
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL")


@pytest.fixture(scope="module")
def cluster():
    with running_slurm_cluster() as cluster:
        yield cluster


def job_state(cluster, job: str) -> dict[str, str]:
    line = cluster.command("scontrol", "show", "job", "--oneliner", job)
    return dict(f.split("=", 1) for f in line.split() if "=" in f)


def wait_for_job(cluster, job: str, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while (state := job_state(cluster, job))["JobState"] not in ENDED:
        if time.monotonic() > deadline:
            cluster.command("scancel", job)
            raise TimeoutError(f"job {job} still {state['JobState']} after {timeout:.0f} s (cancelled)")
        time.sleep(1.0)
    return state


def enter_allocation(cluster, monkeypatch, *options: str) -> str:
    """An allocation of `options` without a shell (`salloc --no-shell`), this process's environment inside
    it; its job id (the caller cancels it)."""
    out = subprocess.run(
        ["salloc", "--no-shell", "--immediate=30", *options],
        env=cluster.env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    job = out.stderr.split("Granted job allocation")[1].split()[0]
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    monkeypatch.setenv("SLURM_JOB_ID", job)
    monkeypatch.setenv("SLURM_JOB_NODELIST", job_state(cluster, job)["NodeList"])
    return job


@pytest.fixture
def allocation(cluster, monkeypatch):
    """A 2-node allocation with one task per node, this process's environment inside it."""
    job = enter_allocation(cluster, monkeypatch, "--nodes=2", "--ntasks-per-node=1", "--job-name=engine-test")
    yield job
    cluster.command("scancel", job)


# A step's task: says where it runs, leaves a double-forked grandchild behind, and on SIGTERM says so and exits.
PROBE = """
import os, signal, sys, time
out = sys.argv[1]
def on_term(signum, frame):
    open(out + ".term", "w").write("SIGTERM"); sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        open(out + ".grandchild", "w").write(str(os.getpid())); time.sleep(300); os._exit(0)
    os._exit(0)
while not os.path.exists(out + ".grandchild"):
    time.sleep(0.01)
open(out + ".ready", "w").write(os.environ["SLURMD_NODENAME"])
time.sleep(300)
"""


@pytest.fixture
def leftovers():
    """Pids a test started on the nodes: whatever of them still runs at its end is killed by pid."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def start_probe(engine, tmp_path: Path, name: str, node: Node, leftovers: list[int]):
    """The child, its output prefix, and the pids of its task and of the task's escaped grandchild."""
    out = tmp_path / name
    command = [sys.executable, "-c", PROBE, str(out)]
    child = engine.start(ProcessSpec(name, "env_worker", ()), node, command, {}, tmp_path / f"{name}.log")
    deadline = time.monotonic() + 30
    while not (out.parent / f"{name}.ready").exists():
        assert time.monotonic() < deadline and child.poll() is None, child.tail()
        time.sleep(0.1)
    pids = [child.pid, int((out.parent / f"{name}.grandchild").read_text())]
    leftovers.extend(pids)
    assert all(alive(p) for p in pids)
    return child, out, pids


def test_engine_places_starts_and_stops_steps(allocation, leftovers, tmp_path):
    from mas_async.launch.engines.slurm import SlurmEngine

    config = load_config(ROOT / "configs/plan_path_tiny.yaml")
    engine = SlurmEngine(config)
    assert engine.nodes == [Node("node1", "127.0.0.1"), Node("node2", "127.0.0.1")]
    placed = {name: node.name for name, node in engine.place(process_specs(config)).items()}
    assert placed == {
        "router": "node1",
        "trainer/vertical": "node1",
        "trainer/horizontal": "node1",
        "inference/vertical/0": "node2",
        "inference/horizontal/0": "node2",
        "env_worker/0": "node1",
        "env_worker/1": "node2",
    }
    config.cluster.slurm.placement = {"inference": 0, "env_worker/0": 1}
    placed = engine.place(process_specs(config))
    assert placed["inference/vertical/0"].name == "node1" and placed["env_worker/0"].name == "node2"
    config.cluster.slurm.placement = {"router": 2}
    with pytest.raises(ConfigError, match=r"cluster.slurm.placement.router=2: the allocation has 2 nodes"):
        engine.place(process_specs(config))

    ports = engine.free_ports(engine.nodes[1], 3)
    assert len(set(ports)) == 3 and all(1024 < p < 65536 for p in ports)

    # terminate(): the task itself gets SIGTERM (scancel --signal=TERM), and the step's end kills the
    # double-forked grandchild (proctrack/cgroup).
    gentle, out, pids = start_probe(engine, tmp_path, "gentle", engine.nodes[1], leftovers)
    assert (out.parent / "gentle.ready").read_text() == "node2"
    gentle.terminate()
    assert gentle.wait(20) is not None
    assert (out.parent / "gentle.term").read_text() == "SIGTERM"
    wait_dead(pids)

    # kill(): SIGTERM to srun, which SIGKILLs the step: the task gets no SIGTERM, nothing is left.
    hard, out, pids = start_probe(engine, tmp_path, "hard", engine.nodes[0], leftovers)
    hard.kill()
    assert hard.wait(20) not in (None, 0)
    assert not (out.parent / "hard.term").exists()
    wait_dead(pids)

    # A failed step: a non-zero status, and srun's report of it in the process's log.
    failed = engine.start(
        ProcessSpec("failing", "env_worker", ()), engine.nodes[1],
        [sys.executable, "-c", "raise SystemExit(3)"], {}, tmp_path / "failing.log",
    )  # fmt: skip
    assert failed.wait(30) not in (None, 0)
    assert "node2: task 0: Exited with exit code 3" in failed.tail()
    engine.close()


def wait_dead(pids: list[int], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"still alive: {[p for p in pids if alive(p)]}"
        time.sleep(0.1)


def test_submitted_script_trains_across_two_nodes(cluster, tmp_path):
    run_dir = tmp_path / "run"
    job_name = f"mas-async-test-{os.getpid()}"
    # What an earlier, ended job of this name left (a process and shared memory), and another job name's.
    shm, other_shm = Path(f"/dev/shm/{job_name}.queue"), Path(f"/dev/shm/other-{job_name}.queue")
    for path in (shm, other_shm):
        path.write_bytes(b"\0" * 4096)
    stale, other = run_process(job_name, "999999"), run_process(f"other-{job_name}", "999999")
    try:
        _train_across_two_nodes(cluster, run_dir, job_name)
        assert stale.wait(timeout=10) is not None and other.poll() is None
        assert not shm.exists() and other_shm.exists()
    finally:
        for proc in (stale, other):
            proc.kill()
            proc.wait(timeout=10)
        for path in (shm, other_shm):
            path.unlink(missing_ok=True)


def _train_across_two_nodes(cluster, run_dir: Path, job_name: str) -> None:
    out = subprocess.run(
        [
            sys.executable, "-m", "mas_async", "slurm", "configs/plan_path_tiny.yaml", "--nodes", "2",
            "--job-name", job_name, "--time", "10:00", "run.iterations=3", *FAST, f"run.output_dir={run_dir}",
        ],
        cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    job = out.stdout.split("submitted job ")[1].split()[0]
    state = wait_for_job(cluster, job, JOB_TIMEOUT_S)
    output = (run_dir / f"slurm-{job}.out").read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", output
    assert state["JobName"] == job_name and state["NumNodes"] == "2"
    assert output.count("mas-async slurm_stale on node") == 2  # the clearing ran once per node
    assert "stopped 1 stale processes" in output

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    for row in rows[:3]:
        for policy in ("vertical", "horizontal"):
            assert row[f"policy/{policy}/version_mismatch"] == 0
            assert row[f"policy/{policy}/logprob_abs_diff"] < 1e-4
    deployment = json.loads((run_dir / "deployment.json").read_text())
    nodes = {name: where["node"] for name, where in deployment["nodes"].items()}
    assert {nodes["router"], nodes["trainer/vertical"], nodes["env_worker/0"]} == {"node1"}
    assert {nodes["inference/vertical/0"], nodes["inference/horizontal/0"], nodes["env_worker/1"]} == {"node2"}
    # Every role recorded its pid on its node; none of them outlives the job.
    pids = json.loads((run_dir / "pids.json").read_text())
    assert set(pids) == set(nodes) and all(isinstance(p, int) for p in pids.values())
    assert not [name for name, pid in pids.items() if alive(pid)]


# A step's task: says which node it is on and which GPUs it sees, then waits for the test's word (bounded).
GPU_PROBE = """
import os, sys, time
out = sys.argv[1]
seen = os.environ.get("CUDA_VISIBLE_DEVICES") or "-"
with open(out + ".ready.part", "w") as f:  # renamed whole: the test never reads a half-written file
    f.write(os.environ["SLURMD_NODENAME"] + " " + seen)
os.replace(out + ".ready.part", out + ".ready")
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(os.path.dirname(out), "release")) and time.monotonic() < deadline:
    time.sleep(0.05)
"""
RESOURCE_OPTIONS = ("--nodes=", "--ntasks-per-node=", "--cpus-per-task=", "--gpus-per-node=", "--mem=")


def test_each_gpu_process_is_a_step_with_gpus_of_its_own(cluster, tmp_path, monkeypatch):
    """The resources the script of a GPU config asks for hold every process of the run at once, each GPU
    process's step seeing only GPUs of its own (the cluster's GPUs are GRES on device files)."""
    resources = every_step_at_once(cluster, tmp_path, monkeypatch)
    assert "--gpus-per-node=2" in resources  # 4 GPU steps packed on 2 nodes: 4 GPUs asked, 4 used


def every_step_at_once(cluster, tmp_path: Path, monkeypatch, *overrides: str) -> list[str]:
    """Submit-as-dry-run the tiny GPU config as a job of 2 nodes, hold the allocation its script asks for, and
    start every process of the run in it as its step at once: each must run without waiting for another's
    CPUs, GPUs or memory, a GPU process seeing GPUs of its own beside its policy's other process. The job's
    resource options."""
    from mas_async.launch.engines.slurm import SlurmEngine

    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "mas_async", "slurm", "configs/plan_path_tiny_gpu.yaml", "--nodes", "2", "--dry-run",
         f"run.output_dir={run_dir}", *overrides],
        cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    sbatch = [
        line.split()[1] for line in (run_dir / "slurm.sbatch").read_text().splitlines() if line.startswith("#SBATCH")
    ]
    resources = [option for option in sbatch if option.startswith(RESOURCE_OPTIONS)]
    # The job's allocation as the script asks for it, held without a shell; inside it, the environment that
    # sbatch gives the batch step (its resource options too, which a step must not inherit).
    job = enter_allocation(cluster, monkeypatch, "--job-name=gpu-steps", *resources)
    monkeypatch.setenv("SLURM_GPUS_PER_NODE", "2")
    engine = None
    try:
        config = load_config(run_dir / "config.yaml")  # the copy the job would run
        engine = SlurmEngine(config)
        specs = process_specs(config)
        placement = engine.place(specs)
        children = {}
        for spec in specs:
            prefix = str(tmp_path / spec.name.replace("/", "-"))
            command = [sys.executable, "-c", GPU_PROBE, prefix]
            children[spec.name] = (engine.start(spec, placement[spec.name], command, {}, Path(prefix + ".log")), prefix)
        seen: dict[str, tuple[str, str]] = {}
        deadline = time.monotonic() + 60
        while len(seen) < len(children):  # all at once: no step waits for another's CPUs or GPUs
            for name, (child, prefix) in children.items():
                assert child.poll() is None, f"{name}: {child.tail()}"
                if name not in seen and Path(prefix + ".ready").exists():
                    node, gpus = Path(prefix + ".ready").read_text().split()
                    seen[name] = (node, gpus)
            assert time.monotonic() < deadline, f"steps not running after 60 s: {sorted(set(children) - set(seen))}"
            time.sleep(0.1)
        for neighbours in (  # each policy's trainer and server packed on one node
            ("trainer/vertical", "inference/vertical/0"),
            ("trainer/horizontal", "inference/horizontal/0"),
        ):
            (node_a, gpus_a), (node_b, gpus_b) = (seen[name] for name in neighbours)
            assert node_a == node_b  # one node ...
            assert len(gpus_a.split(",")) == len(gpus_b.split(",")) == 1 and gpus_a != gpus_b, seen  # ... a GPU each
        assert {seen[name][1] for name in ("router", "env_worker/0", "env_worker/1")} == {"-"}  # no GPU
        (tmp_path / "release").touch()
        assert all(child.wait(30) == 0 for child, _ in children.values())
    finally:
        (tmp_path / "release").touch()
        if engine is not None:
            engine.close()
        cluster.command("scancel", job)
    return resources


def test_a_requeued_job_resumes_its_run_and_runs_every_iteration_once(cluster, tmp_path, monkeypatch):
    """SLURM's warning before the time limit (SIGUSR1 to the batch shell): the run checkpoints, stops and
    requeues its job. Then a preemption (`scontrol requeue`: SIGTERM to everything): the job comes back
    and resumes from that checkpoint. Only those two checkpoints and the final one exist
    (trainer.checkpoint_every=0), and the run ends with every iteration once, strictly on-policy. The run is
    long enough that its second start still has several iterations to go when the preemption comes (with 6,
    a loaded machine once saw the second start finish first)."""
    iterations = 10
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable, "-m", "mas_async", "slurm", "configs/plan_path_tiny_single.yaml", "--nodes", "2",
            "--job-name", f"mas-async-requeue-{os.getpid()}", "--time", "10:00", f"run.iterations={iterations}",
            "trainer.checkpoint_every=0", "trainer.keep_best=false", "cluster.env_workers=1", *FAST,
            f"run.output_dir={run_dir}",
        ],
        cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    job = out.stdout.split("submitted job ")[1].split()[0]
    output = run_dir / f"slurm-{job}.out"
    try:
        wait_for(lambda: len(metrics_rows(run_dir)) >= 2, 120, "two iterations of the first start", output)
        # The launcher's time-limit watch reads the job's end time as SLURM has it (--time 10:00).
        monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
        end = job_end_time(job, 30)
        assert end is not None and time.time() < end <= time.time() + 600, end
        done_before = len(metrics_rows(run_dir))
        cluster.command("scancel", "--batch", "--signal=USR1", job)  # what --signal=B:USR1@N sends
        done_after = len(metrics_rows(run_dir))
        wait_for(lambda: "start 2," in read(output), 120, "the job's second start", output)
        stopped = int(read(output).split("stopped at the checkpoint of version ")[1].split(",")[0])
        # After the step of the iteration in progress, or of the next one if the signal came during a step.
        assert done_before + 1 <= stopped <= done_after + 2 < iterations - 3, (done_before, done_after, stopped)
        wait_for(lambda: f"from its checkpoint of version {stopped}" in read(output), 60, "the resume", output)
        wait_for(lambda: len(metrics_rows(run_dir)) > stopped, 120, "an iteration of the second start", output)
        cluster.command("scontrol", "requeue", job)  # a preemption
        state = wait_for_job(cluster, job, JOB_TIMEOUT_S)
    except BaseException:
        cluster.command("scancel", job)
        raise
    text = read(output)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0" and state["Restarts"] == "2", text
    assert "start 3," in text and text.count(f"from its checkpoint of version {stopped}") == 2, text
    rows = metrics_rows(run_dir)
    assert [r["iteration"] for r in rows] == list(range(iterations + 1)), text  # every iteration once, none lost
    for row in rows[:iterations]:
        assert row["policy/solo/version"] == row["iteration"]
        assert row["policy/solo/version_mismatch"] == 0
        assert row["policy/solo/logprob_abs_diff"] < 1e-4  # the servers resumed with the trainer's weights
    versions = sorted(int(p.name[1:]) for p in (run_dir / "checkpoints" / "solo").iterdir() if p.name.startswith("v"))
    assert versions == [stopped, iterations]
    # Each checkpoint's time is in its row, for the next start's time-limit watch to size its stop by.
    assert rows[stopped - 1]["policy/solo/checkpoint_s"] > 0


def metrics_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def wait_for(check, timeout: float, what: str, output: Path) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s; the job's output:\n{read(output)}")
        time.sleep(0.5)
