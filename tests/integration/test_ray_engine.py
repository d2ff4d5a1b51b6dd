"""Ray for real (`cluster.engine: ray`): a local multi-node Ray cluster (`ray.cluster_utils.Cluster`: a head
and two nodes, each offering its own custom resource) runs `mas-async train` with the router and trainers
pinned to one node and the inference servers and env workers to the other; SIGINT to the launcher once
every process runs leaves no process of the run, no actor and no placement group; the engine's `close`
itself kills a process and releases its actor and group; resources no node has are a named error.

The cluster is shared by the module's tests and torn down by `Cluster.shutdown`, then by pid whatever it
started that is still alive (never `ray stop`: it kills every Ray process on the machine)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tests.integration.launch import FAST, ROOT, alive, child_pids, cleanup, start_train

ray = pytest.importorskip("ray", reason="needs Ray: pip install 'mas-async[ray]'")

CONFIG = "configs/plan_path_tiny.yaml"
PINNED = [  # router and trainers on node_a's node, inference servers and env workers on node_b's
    "cluster.ray.resources.router.node_a=1",
    "cluster.ray.resources.trainer.node_a=1",
    "cluster.ray.resources.inference.node_b=1",
    "cluster.ray.resources.env_worker.node_b=1",
]
NODE_OF_ROLE = {"router": "node_a", "trainer": "node_a", "inference": "node_b", "env_worker": "node_b"}


@pytest.fixture(scope="module")
def ray_cluster():
    """(GCS address, custom resource -> Ray node id) of a head with no CPUs and two 4-CPU nodes."""
    from ray.cluster_utils import Cluster

    before = _descendants()
    with pytest.MonkeyPatch.context() as env:
        # Ray's processes inherit this environment: its workers import this checkout's mas_async.
        env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        # Ray's own backstop (a worker kills its children as it exits) off: what the tests see is the engine's.
        # No dashboard and no idle workers started ahead (they cost half a minute of CPU on 2 cores).
        system = {"kill_child_processes_on_worker_exit": False, "enable_worker_prestart": False}
        head = {"num_cpus": 0, "include_dashboard": False, "_system_config": system}
        cluster = Cluster(initialize_head=True, head_node_args=head)
        try:
            nodes = {name: cluster.add_node(num_cpus=4, resources={name: 8}) for name in ("node_a", "node_b")}
            cluster.wait_for_nodes(timeout=60)
            ray.init(address=cluster.address, logging_level="WARNING")  # ours: to read the placement groups
            yield cluster.address, {name: node.node_id for name, node in nodes.items()}
        finally:
            ray.shutdown()
            started = _descendants() - before  # the cluster's processes and its workers
            cluster.shutdown()
            for pid in started:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _groups_of(launcher_pid: int) -> dict[str, str]:
    """Placement group id -> state, of the run whose launcher has this pid (the engine names them so)."""
    table = ray.util.placement_group_table()
    return {gid: g["state"] for gid, g in table.items() if g["name"] == f"mas-async/plan_path_tiny/{launcher_pid}"}


def test_three_iterations_with_roles_pinned_to_two_nodes(ray_cluster, tmp_path):
    address, node_ids = ray_cluster
    run_dir = tmp_path / "run"
    overrides = ["run.iterations=3", *FAST, "cluster.engine=ray", f"cluster.ray.address={address}", *PINNED]
    proc = start_train(CONFIG, run_dir, *overrides)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]  # 3 training iterations + the final evaluation
    for row in rows[:3]:
        for policy in ("vertical", "horizontal"):
            assert row[f"policy/{policy}/version_mismatch"] == 0
            assert row[f"policy/{policy}/logprob_abs_diff"] < 1e-4  # servers ran exactly the trainer's weights
    nodes = json.loads((run_dir / "deployment.json").read_text())["nodes"]
    assert len(nodes) == 7
    placed = {name: place["node"] for name, place in nodes.items()}
    assert placed == {name: node_ids[NODE_OF_ROLE[name.split("/")[0]]] for name in nodes}
    assert set(_groups_of(proc.pid).values()) == {"REMOVED"}


def test_sigint_leaves_no_process_and_no_placement_group(ray_cluster, tmp_path):
    address, _ = ray_cluster
    run_dir = tmp_path / "run"
    overrides = ["run.iterations=500", *FAST, "cluster.engine=ray", f"cluster.ray.address={address}", *PINNED]
    proc = start_train(CONFIG, run_dir, *overrides)
    try:
        pids = child_pids(run_dir, timeout=120)  # written once every process was started on its node
        hosts = {psutil.Process(pid).ppid() for pid in pids.values()}  # the Ray actors that started them
        assert len(hosts) == len(pids)
        titles = {pid: psutil.Process(pid).cmdline()[0] for pid in hosts}  # Ray titles an actor by its class,
        assert all(re.fullmatch(r"ray::ProcessHost(\.\w+)?", t) for t in titles.values()), titles  # + a running method
        assert list(_groups_of(proc.pid).values()) == ["CREATED"]
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, out
        deadline = time.monotonic() + 5  # the launcher exits after its children (and their actors) are gone
        while time.monotonic() < deadline and any(alive(p) for p in [*pids.values(), *hosts]):
            time.sleep(0.2)
        assert not [name for name, pid in pids.items() if alive(pid)]
        assert not [pid for pid in hosts if alive(pid)]
        assert list(_groups_of(proc.pid).values()) == ["REMOVED"]
    finally:
        cleanup(proc, run_dir)


# The engine alone, driven by a script that waits for a line on stdin between steps. It keeps its connection
# after `close` (ray.shutdown a no-op), so what is seen released is what `close` released: Ray would
# release a finished driver's group and actors by itself.
ENGINE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import ray
    ray.shutdown = lambda: None
    from mas_async.config import load_config
    from mas_async.launch.engines.base import ProcessSpec
    from mas_async.launch.engines.ray import RayEngine

    address, log = sys.argv[1:]
    overrides = ["cluster.engine=ray", f"cluster.ray.address={address}", "cluster.ray.resources.env_worker.node_b=1"]
    engine = RayEngine(load_config("configs/plan_path_tiny.yaml", overrides))
    spec = ProcessSpec("env_worker/0", "env_worker", ())
    node = engine.place([spec])[spec.name]
    lost = engine.start(spec, node, ["sleep", "300"], {}, Path(log))
    lost.kill()
    lost.wait(10)
    # A lost process started again on its host, and a restarted run placed again: the same node, one group.
    child = engine.start(spec, engine.place([spec])[spec.name], ["sleep", "300"], {}, Path(log))
    print(json.dumps({"pid": child.pid, "lost": lost.pid, "node": node.name, "status": child.poll()}), flush=True)
    sys.stdin.readline()
    engine.close()
    print("closed", flush=True)
    sys.stdin.readline()
    """
)


def test_close_kills_the_process_and_releases_actors_and_group(ray_cluster, tmp_path):
    address, node_ids = ray_cluster
    script = [sys.executable, "-c", ENGINE_SCRIPT, address, str(tmp_path / "sleep.log")]
    driver = subprocess.Popen(script, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        started = json.loads(_line(driver, timeout=120))
        assert started["node"] == node_ids["node_b"] and started["status"] is None
        assert started["pid"] != started["lost"] and not alive(started["lost"])
        host = psutil.Process(started["pid"]).ppid()
        assert psutil.Process(host).cmdline()[0] == "ray::ProcessHost"
        assert list(_groups_of(driver.pid).values()) == ["CREATED"]
        driver.stdin.write("\n")
        driver.stdin.flush()
        assert _line(driver, timeout=60) == "closed\n"
        assert not alive(started["pid"])  # close killed the process (its actor reaped it)...
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and alive(host):
            time.sleep(0.1)
        assert not alive(host)  # ...the actor is gone, and the group released while the driver still runs
        assert list(_groups_of(driver.pid).values()) == ["REMOVED"]
        driver.stdin.write("\n")
        driver.stdin.flush()
        assert driver.wait(timeout=30) == 0
    finally:
        driver.kill()
        driver.wait(timeout=10)


def _line(driver: subprocess.Popen, timeout: float) -> str:
    if not select.select([driver.stdout], [], [], timeout)[0]:
        raise TimeoutError(f"the engine script said nothing in {timeout:.0f} s")
    return driver.stdout.readline()


def test_resources_no_node_has_are_named(ray_cluster, tmp_path):
    address, _ = ray_cluster
    run_dir = tmp_path / "run"
    overrides = ["run.iterations=1", *FAST, "cluster.engine=ray", f"cluster.ray.address={address}"]
    overrides += ["cluster.ray.placement_timeout_s=2", "cluster.ray.resources.inference.node_c=1"]
    proc = start_train(CONFIG, run_dir, *overrides)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 2, out
    assert "no node of the cluster has inference/vertical/0" in out and "'node_c': 1.0" in out, out
    assert set(_groups_of(proc.pid).values()) == {"REMOVED"}
