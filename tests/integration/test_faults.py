"""Lost processes in a real run, by real SIGKILLs: env workers and inference replicas are started again while
the run goes on (episodes run again from the start elsewhere, requests go to a live replica or wait for
the replacement, the weight group is re-formed; none lost, none twice), and a lost trainer or router
restarts the whole run from its last complete checkpoint (every iteration exactly once in metrics.jsonl)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from bench.slow_backend import FIRST_ENV, REPLACEMENT_ENV
from mas_async.metrics import Keys
from tests.integration.launch import alive, child_pids, cleanup, kill_when, start_train, wait_for_rows

CONFIG = "configs/plan_path_tiny.yaml"
POLICIES = ("vertical", "horizontal")
KILLS = 8
"""Most kills of the chaos test."""
SLOW_HF = "bench.slow_backend:SlowHF"
POISON_ENV = "tests.support.poison_env:PoisonPlanPath"


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _joined(run_dir: Path, name: str, pid: int) -> bool:
    """The router saw process `name` with `pid` say Hello (so a kill of it is a restart the router counts)."""
    log = (run_dir / "logs" / "router.log").read_text(errors="replace")
    return f"{name} joined (pid {pid})" in log


def _check_every_iteration_once(rows: list[dict], iterations: int, batch_size: int) -> None:
    assert [r[Keys.ITERATION] for r in rows] == list(range(iterations + 1))  # none lost, none repeated
    for row in rows[:iterations]:
        assert row[Keys.TRAIN_EPISODES] == batch_size and row[Keys.TRAIN_DROPPED] == 0, row
        for policy in POLICIES:
            assert row[Keys.policy(policy, "version")] == row[Keys.ITERATION]
            assert row[Keys.policy(policy, "episodes")] == batch_size, row  # by episode id, at the trainer
            assert row[Keys.policy(policy, "repeated_episodes")] == 0, row
            assert row[Keys.policy(policy, Keys.VERSION_MISMATCH)] == 0
            assert row[Keys.policy(policy, Keys.LOGPROB_DIFF)] < 1e-4


def _started(run_dir: Path) -> int:
    """How many times the run has started (its routers, each saw every peer join)."""
    return len(re.findall(r"all \d+ peers joined", (run_dir / "logs" / "router.log").read_text(errors="replace")))


def _stepping(run_dir: Path) -> int:
    """How many steps trainer/vertical has begun (its log, over every start of the run)."""
    log = run_dir / "logs" / "trainer-vertical.log"
    return log.read_text(errors="replace").count(": stepping from v") if log.exists() else 0


def _replaced(run_dir: Path, name: str, pid: int, deadline: float) -> int:
    """The pid of the process the launcher started in place of `name`'s `pid`."""
    while (new := json.loads((run_dir / "pids.json").read_text())[name]) == pid:
        assert time.monotonic() < deadline, f"{name} (pid {pid}) was never replaced"
        time.sleep(0.01)
    return new


@pytest.mark.parametrize("leases", [False, True], ids=["routed", "leases"])
def test_env_workers_and_replicas_killed_at_random_lose_and_repeat_nothing(tmp_path, leases):
    """Chaos, seeded and bounded: once per new row of metrics (0.1-0.6 s after it, so the run has moved on
    between kills on any machine's speed), SIGKILL a random env worker or (one time in three) inference
    replica that the router has seen join, at most `KILLS` of them; the first replica kill lands as a step
    begins, before its weight update, and its replacement is killed too while its model loads, before its
    Hello (replacements of vertical's replicas take 1 s to load); the first env worker is hung (SIGSTOP)
    rather than killed: the router finds it silent and the launcher kills it. Each is replaced alone; the
    run never restarts. With `cluster.leases` the workers' requests go straight to the replicas and their
    groups straight to the trainers: a lost worker's groups of an attempt the router never accepted are
    dropped by the trainer, never trained on, and every group that trained is one the router accepted."""
    run_dir, iterations, batch = tmp_path / "run", 20, 4
    args = [f"run.iterations={iterations}", f"rollout.batch_size={batch}", "algorithm.k=4", "eval.every=5",
            "eval.size=4", "cluster.env_workers=2", "policies.vertical.replicas=2", "policies.horizontal.replicas=2",
            "trainer.checkpoint_every=2", "trainer.keep_checkpoints=1", "cluster.max_restarts=30",
            "cluster.peer_timeout_s=6", f"policies.vertical.backend={SLOW_HF}", f"cluster.leases={str(leases).lower()}"]  # fmt: skip
    workers = ["env_worker/0", "env_worker/1"]
    replicas = [f"inference/{p}/{r}" for p in POLICIES for r in (0, 1)]
    proc = start_train(CONFIG, run_dir, *args, env={REPLACEMENT_ENV: "1"})
    rng, kills, in_step, hung, loading = random.Random(7), [], False, False, 0
    try:
        child_pids(run_dir)
        wait_for_rows(run_dir, 2, timeout=120)
        deadline = time.monotonic() + 300
        seen = len(_rows(run_dir))
        while seen < iterations - 4 and len(kills) < KILLS and time.monotonic() < deadline and proc.poll() is None:
            if not in_step:  # the first replica kill: inference/vertical/0 as trainer/vertical begins a step
                steps = _stepping(run_dir)
                while _stepping(run_dir) == steps and time.monotonic() < deadline:
                    time.sleep(0.01)
                name, in_step = "inference/vertical/0", True
            else:
                while len(_rows(run_dir)) == seen and time.monotonic() < deadline and proc.poll() is None:
                    time.sleep(0.02)
                time.sleep(rng.uniform(0.1, 0.6))
                name = rng.choice(replicas) if rng.random() < 1 / 3 else rng.choice(workers)
            seen = len(_rows(run_dir))
            pid = json.loads((run_dir / "pids.json").read_text())[name]
            if _joined(run_dir, name, pid) and alive(pid):
                hang = name in workers and not hung  # the first env worker "kill" is a hang: SIGSTOP
                os.kill(pid, signal.SIGSTOP if hang else signal.SIGKILL)
                kills.append(name.split("/")[0])
                if name == "inference/vertical/0" and not loading:  # its replacement dies while it loads
                    new = _replaced(run_dir, name, pid, deadline)
                    assert not _joined(run_dir, name, new), "the replacement said Hello within 1 s of its start"
                    os.kill(new, signal.SIGKILL)
                    kills.append("inference")
                    loading += 1
                while hang and json.loads((run_dir / "pids.json").read_text())[name] == pid:
                    assert time.monotonic() < deadline, f"{name} hung (SIGSTOP) was never replaced"
                    time.sleep(0.1)  # the router finds it silent, the launcher kills it and starts it again
                hung = hung or hang
        out, _ = proc.communicate(timeout=300)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out[-3000:]
    assert len(kills) >= 5 and kills.count("inference") >= 2 and kills.count("env_worker") >= 3, kills
    assert loading == 1
    rows = _rows(run_dir)
    _check_every_iteration_once(rows, iterations, batch)
    for role in ("env_worker", "inference"):  # every kill, counted once (rows run again carry theirs over)
        assert sum(r[Keys.restarts(role)] for r in rows) == kills.count(role), (role, kills)
    assert sum(r[Keys.restarts(role)] for r in rows for role in ("trainer", "router")) == 0
    assert sum(r[Keys.REISSUED_EPISODES] for r in rows) >= 1
    router_log = (run_dir / "logs" / "router.log").read_text(errors="replace")
    resent = [int(n) for n in re.findall(r"its (\d+) requests were sent again", router_log)]
    assert len(resent) == kills.count("inference") - loading  # (the one killed loading had no request)
    reissued = sum(r[Keys.REISSUED_REQUESTS] for r in rows)
    if not leases:
        assert reissued == sum(resent)
    else:  # the workers send a lost replica's requests again themselves, and report them with an EpisodeDone
        logs = [path.read_text(errors="replace") for path in (run_dir / "logs").glob("env_worker-*.log")]
        by_workers = sum(int(n) for log in logs for n in re.findall(r"; (\d+) requests sent again", log))
        assert sum(resent) <= reissued <= sum(resent) + by_workers  # (a worker killed before its report: lost)
    replica_log = (run_dir / "logs" / "inference-vertical-0.log").read_text(errors="replace")
    assert "loading slowly: 1s" in replica_log  # (the one killed while it loaded may not have said so yet)
    recoveries = [r[Keys.RECOVERY_S] for r in rows if r[Keys.RECOVERY_S] > 0]
    assert recoveries and max(recoveries) < 30
    assert out.count("started it again as pid") == len(kills)
    assert out.count("was declared lost by the router") == 1  # the hung one, killed on the router's word
    assert "restarting the run" not in out and _started(run_dir) == 1
    assert router_log.count("re-forming the weight group of") >= 1
    if leases:  # every episode's groups that trained came straight to its trainer, accepted by the router
        trained = sum(r[Keys.policy(policy, "episodes")] for r in rows[:iterations] for policy in POLICIES)
        assert sum(r[Keys.DIRECT_GROUPS] for r in rows) == trained and sum(r[Keys.ROUTED_REQUESTS] for r in rows) == 0


@pytest.mark.parametrize("leases", [False, True], ids=["routed", "leases"])
def test_a_lone_replica_killed_during_a_weight_update_is_replaced_alone_and_joins_the_next_version(tmp_path, leases):
    """The policy's only replica is SIGKILLed as its trainer begins a step: the trainer's send cannot reach
    it, the router holds the policy's requests, the replacement (the same process role, a new pid) joins
    a re-formed weight group and loads the version the trainer sends there, never the broadcast that was
    in flight; the run goes on without a restart and every iteration is there once. With `cluster.leases`
    the lease of the policy is empty meanwhile: the workers send its requests through the router, which
    holds them for the replacement; once that serves, it is leased again and served directly."""
    run_dir, iterations, batch = tmp_path / "run", 6, 4
    args = [f"run.iterations={iterations}", f"rollout.batch_size={batch}", "algorithm.k=4", "eval.every=3",
            "eval.size=4", "policies.vertical.replicas=1", "policies.horizontal.replicas=1",
            f"cluster.leases={str(leases).lower()}",
            # The batch step: its compute after TrainStep leaves the kill below time to land before the send
            # (a streamed step has computed the iteration's groups by then and sends within milliseconds).
            "trainer.streaming=false"]  # fmt: skip
    proc = start_train(CONFIG, run_dir, *args)
    try:
        child_pids(run_dir)
        killed = kill_when(run_dir, "inference/vertical/0", "trainer/vertical", r"iteration 2: stepping from v2")
        out, _ = proc.communicate(timeout=300)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out[-3000:]
    assert "restarting the run" not in out and "started it again as pid" in out
    rows = _rows(run_dir)
    _check_every_iteration_once(rows, iterations, batch)
    assert sum(r[Keys.restarts("inference")] for r in rows) == 1
    assert sum(r[Keys.restarts(role)] for r in rows for role in ("trainer", "router", "env_worker")) == 0
    log = (run_dir / "logs" / "inference-vertical-0.log").read_text(errors="replace")
    assert "joined as rank 1 of 2 (generation 0)" in log
    assert killed not in json.loads((run_dir / "pids.json").read_text()).values()
    # The loss took the replica out at once (generation 1: no replica, the step completed without it); the
    # replacement caught up alone with the trainer (generation 2) to v3, then joined generation 3: the step's
    # own broadcast never reached it.
    after = log[log.index("(generation 2)") :]
    assert "joined as rank 1 of 2 (generation 3)" in after
    loads = re.findall(r"weights v(\d+) loaded", after)
    assert loads and loads[0] == "3", loads
    assert re.findall(r"weights v(\d+) loaded", log[: log.index("(generation 2)")]) == ["1", "2"]
    router_log = (run_dir / "logs" / "router.log").read_text(errors="replace")
    assert "re-forming the weight group of vertical: generation 1, replicas []" in router_log
    trainer_log = (run_dir / "logs" / "trainer-vertical.log").read_text(errors="replace")
    assert "replicas [0] of vertical caught up to v3 (generation 2)" in trainer_log
    if leases:
        _check_leased(run_dir, rows)
        # Meanwhile vertical's lease was empty on every worker (a request it needed then went through the
        # router, which held it for the replacement: whether one was needed in those ~0.5 s is timing).
        for worker_log in (run_dir / "logs").glob("env_worker-*.log"):
            assert "lease of vertical: 0 replicas (['inference/vertical/0'] left" in worker_log.read_text()
        assert re.search(
            r"recovered from a lost replica in [\d.]+s \(inference/vertical/0 is leased again\)", router_log
        )


def _check_leased(run_dir: Path, rows: list[dict]) -> None:
    """A run with `cluster.leases` that lost a replica: every request the workers sent directly was taken by a
    replica or was sent again when its replica left the lease (each counted once), and the rows' re-sent
    requests are those the workers' logs and the router's log name."""
    direct = sum(r[Keys.DIRECT_REQUESTS] for r in rows)
    taken = 0
    for log_path in (run_dir / "logs").glob("inference-*.log"):
        taken += sum(int(n) for n in re.findall(r"took (\d+) requests directly", log_path.read_text(errors="replace")))
    resent_by_workers = sum(
        int(n)
        for log_path in (run_dir / "logs").glob("env_worker-*.log")
        for n in re.findall(r"; (\d+) requests sent again", log_path.read_text(errors="replace"))
    )
    router_log = (run_dir / "logs" / "router.log").read_text(errors="replace")
    resent_by_router = sum(int(n) for n in re.findall(r"its (\d+) requests were sent again", router_log))
    assert sum(r[Keys.REISSUED_REQUESTS] for r in rows) == resent_by_workers + resent_by_router
    assert direct > 0 and taken > 0 and taken <= direct  # (the killed replica never said what it took)
    assert sum(r[Keys.STALE_RESULTS] for r in rows) <= resent_by_workers


def _run_restarted_after(tmp_path: Path, name: str, watched: str, pattern: str, delay_s: float = 0.0) -> None:
    run_dir, iterations, batch = tmp_path / "run", 6, 4
    args = [f"run.iterations={iterations}", f"rollout.batch_size={batch}", "algorithm.k=4", "eval.every=2",
            "eval.size=4", "trainer.checkpoint_every=2"]  # fmt: skip
    proc = start_train(CONFIG, run_dir, *args)
    try:
        child_pids(run_dir)
        kill_when(run_dir, name, watched, pattern, delay_s)
        out, _ = proc.communicate(timeout=300)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out[-3000:]
    # v4 is checkpointed after iteration 3's step: killed before that, the run lost iteration 3 and goes back to
    # v2. A streamed step can be over, v4 saved, within the 20 ms the kill polls at (seen once on a loaded
    # machine): the run then goes back to v4, and loses nothing it had not checkpointed.
    restarted = re.search(r"restarting the run from its checkpoint of version (\d+)", out)
    assert restarted is not None and int(restarted[1]) in (2, 4), out[-3000:]
    version = int(restarted[1])
    rows = _rows(run_dir)
    _check_every_iteration_once(rows, iterations, batch)
    # The launcher's lines: each iteration before the checkpoint printed once (not again after the restart).
    printed = [int(i) for i in re.findall(r"^iter +(\d+)/", out, re.MULTILINE)]
    assert set(printed) == set(range(iterations + 1)) and all(printed.count(i) == 1 for i in range(version)), out
    role = name.split("/")[0]
    expected = [0] * (iterations + 1)
    expected[version] = 1  # in the first row after the restart
    assert [r[Keys.restarts(role)] for r in rows] == expected
    assert rows[version][Keys.RECOVERY_S] > 0


def test_a_trainer_killed_mid_step_restarts_the_run_from_its_checkpoint(tmp_path):
    _run_restarted_after(tmp_path, "trainer/vertical", "trainer/vertical", r"iteration 3: stepping from v3")


def test_the_router_killed_mid_iteration_restarts_the_run_from_its_checkpoint(tmp_path):
    # v3 loaded by the vertical replica: iteration 3's episodes start (an iteration can take under 0.3 s, so
    # the kill follows the load closely rather than waiting out a guess of the step's length)
    _run_restarted_after(tmp_path, "router", "inference/vertical/0", r"weights v3 loaded in", delay_s=0.05)


def test_a_replica_replaced_after_a_restart_and_a_prune_loads_the_checkpoint_it_was_given(tmp_path):
    # A whole-run restart starts every process from its checkpoint (deployment.json); the run trains on and
    # prunes to its newest checkpoint. A replica killed then is started again from the restart's checkpoint,
    # which must still be there (the soak's replacements failed 400 times in a row when it was pruned).
    run_dir, iterations, batch = tmp_path / "run", 8, 4
    args = [f"run.iterations={iterations}", f"rollout.batch_size={batch}", "algorithm.k=4", "eval.every=4",
            "eval.size=4", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=1", "trainer.keep_best=false"]  # fmt: skip
    proc = start_train(CONFIG, run_dir, *args)
    try:
        child_pids(run_dir)
        kill_when(run_dir, "trainer/vertical", "trainer/vertical", r"iteration 3: stepping from v3")
        kill_when(run_dir, "inference/vertical/0", "trainer/vertical", r"iteration 7: stepping from v7")
        out, _ = proc.communicate(timeout=300)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out[-3000:]
    restarted = re.search(r"restarting the run from its checkpoint of version (\d+)", out)
    assert restarted is not None and int(restarted[1]) in (2, 4), out[-3000:]
    rows = _rows(run_dir)
    _check_every_iteration_once(rows, iterations, batch)
    assert sum(r[Keys.restarts("inference")] for r in rows) == 1, out[-3000:]  # one replacement, which started


def test_a_replica_lost_while_it_loads_and_a_slower_replacement_leave_the_run_stepping(tmp_path):
    """inference/vertical/0 takes 3 s to load at its first start and is SIGKILLed meanwhile, before its Hello:
    the launcher tells the router, which takes it out of the first generation of vertical's weight group
    (replica 1 alone) and starts the run without it. Its replacement takes 8 s to load, longer than
    trainer.weight_sync_timeout_s (5 s): the run keeps stepping with replica 1 meanwhile, then the
    replacement joins, catches up alone to the version the others hold, and serves. No whole-run restart."""
    run_dir, iterations, batch, name = tmp_path / "run", 40, 4, "inference/vertical/0"
    args = [f"run.iterations={iterations}", f"rollout.batch_size={batch}", "algorithm.k=4", "eval.every=0",
            "policies.vertical.replicas=2", f"policies.vertical.backend={SLOW_HF}",
            "trainer.weight_sync_timeout_s=5"]  # fmt: skip
    proc = start_train(CONFIG, run_dir, *args, env={FIRST_ENV: json.dumps({"0": 3}), REPLACEMENT_ENV: "8"})
    try:
        pid = child_pids(run_dir)[name]
        deadline = time.monotonic() + 120
        time.sleep(0.5)
        assert not _joined(run_dir, name, pid)
        os.kill(pid, signal.SIGKILL)
        new = _replaced(run_dir, name, pid, deadline)
        while not _joined(run_dir, name, new):  # the replacement loads for 8 s: the run steps meanwhile
            assert time.monotonic() < deadline and proc.poll() is None, "the replacement never joined"
            time.sleep(0.05)
        stepped_meanwhile = len(_rows(run_dir))
        out, _ = proc.communicate(timeout=300)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out[-3000:]
    assert "restarting the run" not in out and _started(run_dir) == 1
    assert stepped_meanwhile >= 3, stepped_meanwhile
    rows = _rows(run_dir)
    _check_every_iteration_once(rows, iterations, batch)
    assert sum(r[Keys.restarts("inference")] for r in rows) == 1
    router_log = (run_dir / "logs" / "router.log").read_text(errors="replace")
    assert f"{name} (pid {pid}) died before it joined" in router_log
    assert "re-forming the weight group of vertical: generation 1, replicas [1]" in router_log
    served = re.findall(rf"{name} serves vertical v(\d+)", router_log)
    assert len(served) == 1 and int(served[0]) >= stepped_meanwhile - 1, served
    log = (run_dir / "logs" / "inference-vertical-0.log").read_text(errors="replace")
    after = log[log.index("loading slowly: 8s") :]
    assert "(generation 0)" not in after  # the replacement never joined the first generation
    assert re.findall(r"weights v(\d+) loaded", after)[0] == served[0]  # its catch-up: the version held
    trainer_log = (run_dir / "logs" / "trainer-vertical.log").read_text(errors="replace")
    assert f"replicas [0] of vertical caught up to v{served[0]}" in trainer_log


def test_an_episode_that_kills_its_env_worker_is_dropped_after_its_attempts_and_the_run_goes_on(tmp_path):
    """Problem train3 SIGKILLs whichever env worker resets an env on it. Its episode runs rollout.max_attempts
    (3) times, the last one alone on a worker, each time killing its worker (3 restarts), then it is dropped
    and counted as poisoned with its problem id; the iteration goes on with the other episodes, and when the
    problem comes round again (the next epoch) it is counted without being run. No whole-run restart."""
    run_dir, iterations, batch = tmp_path / "run", 4, 4
    args = [f"run.iterations={iterations}", f"rollout.batch_size={batch}", "algorithm.k=4", "eval.every=0",
            f"env.name={POISON_ENV}", "env.train_size=8", "cluster.env_workers=2", "rollout.max_attempts=3",
            "cluster.max_restarts=5"]  # fmt: skip
    proc = start_train(CONFIG, run_dir, *args)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out[-3000:]
    assert "restarting the run" not in out
    rows = _rows(run_dir)
    assert [r[Keys.ITERATION] for r in rows] == list(range(iterations + 1))
    for row in rows[:iterations]:  # two epochs of 8 problems: train3 once in each
        assert row[Keys.TRAIN_EPISODES] + row[Keys.TRAIN_DROPPED] == batch
        assert row[Keys.TRAIN_DROPPED] == row[Keys.POISONED]  # nothing else dropped: its neighbours ran
    assert [r[Keys.POISONED] for r in rows[:2]].count(1) == 1 and [r[Keys.POISONED] for r in rows[2:4]].count(1) == 1
    assert sum(r[Keys.restarts("env_worker")] for r in rows) == 3
    router_log = (run_dir / "logs" / "router.log").read_text(errors="replace")
    assert router_log.count("dropped as poisoned") == 1
    assert re.search(r"episode train\d-\d \(problem train3\) was running on 3 lost env workers: dropped as poisoned",
                     router_log)  # fmt: skip
    assert re.search(r"episode train\d-\d \(problem train3\) is not run: the problem was poisoned", router_log)


@pytest.mark.parametrize("leases", [False, True], ids=["routed", "leases"])
def test_a_replica_killed_while_samples_of_two_versions_are_in_flight_with_bounded_staleness(tmp_path, leases):
    """rollout.max_staleness=1: while the step from v3 runs, iteration 4's episodes sample at v3, then at v4
    once it is loaded. inference/vertical/0 is SIGKILLed as that step begins: its requests go to replica 1,
    it leaves the weight group, its replacement catches up and serves. No sample outside the window, none
    refused, every sample's log-probs match the trainer's recompute under the version that made it. With
    `cluster.leases` the workers send the lost replica's requests again, to replica 1, the one left in the
    lease, and the replacement is leased again once it serves."""
    run_dir, iterations, batch = tmp_path / "run", 8, 4
    # A broadcast that waits on the killed replica ends at trainer.weight_sync_timeout_s, then goes again
    # without it: a bound well inside this test's own (300 s, the default's).
    args = [f"run.iterations={iterations}", f"rollout.batch_size={batch}", "algorithm.k=4", "eval.every=0",
            "rollout.max_staleness=1", "policies.vertical.replicas=2", "trainer.weight_sync_timeout_s=60",
            f"cluster.leases={str(leases).lower()}"]  # fmt: skip
    proc = start_train(CONFIG, run_dir, *args)
    try:
        child_pids(run_dir)
        kill_when(run_dir, "inference/vertical/0", "trainer/vertical", r"iteration 3: stepping from v3")
        out, _ = proc.communicate(timeout=300)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out[-3000:]
    assert "restarting the run" not in out and "started it again as pid" in out
    rows = _rows(run_dir)
    _check_every_iteration_once(rows, iterations, batch)
    assert sum(r[Keys.restarts("inference")] for r in rows) == 1
    stale = 0
    for row in rows[:iterations]:
        for policy in POLICIES:
            key = f"policy/{policy}/"
            assert row[key + "stale_dropped"] == 0 and row[key + "staleness_max"] <= 1
            assert row[key + "stale_unchecked_samples"] == 0
            stale += row[key + "stale_samples"]
    assert stale > 0, "no sample of the version before was trained on: the versions never overlapped"
    router_log = (run_dir / "logs" / "router.log").read_text(errors="replace")
    assert re.search(r"inference/vertical/0 serves vertical v\d+", router_log)
    if leases:
        _check_leased(run_dir, rows)
        assert sum(r[Keys.ROUTED_REQUESTS] for r in rows) == 0  # replica 1 was leased throughout
        assert re.search(
            r"recovered from a lost replica in [\d.]+s \(inference/vertical/0 is leased again\)", router_log
        )


def _wait_for(path: Path, pattern: str, deadline: float, proc) -> list[re.Match]:
    """Every match of `pattern` in the log at `path` once there is one (polled; TimeoutError at `deadline`)."""
    while time.monotonic() < deadline and proc.poll() is None:
        matches = list(re.finditer(pattern, path.read_text(errors="replace"))) if path.exists() else []
        if matches:
            return matches
        time.sleep(0.02)
    raise TimeoutError(f"{path.name} never matched {pattern!r}")


def test_a_worker_lost_while_its_streamed_groups_wait_for_a_slow_pass_leaves_every_sample_trained_once(tmp_path):
    """Groups stream by turn (the default: tree sampling, agent_turn, std_scope group) and trainer/vertical's
    first compute pass of iteration 1 takes 10 s (tests/support/slow_pass.py). That pass holds the turn-0
    group of an episode; the episode's next group comes and waits for the pass; then the episode's env worker
    is SIGKILLed. The router withdraws the attempt: its waiting groups are dropped, and freed, before any pass
    took them; its computed group makes the step compute again from v1 at its end; the episode runs again
    (attempt 1), and the samples decoded next take the freed addresses. Every sample given and not withdrawn
    is trained once (a step that named withdrawn samples by id() took those for withdrawn ones and stopped
    the run), and the run finishes with every iteration once and the lost worker replaced."""
    from tests.support.slow_pass_roles import SLOW_ITERATION, SLOW_POLICY

    run_dir, iterations, batch = tmp_path / "run", 4, 4
    args = [f"run.iterations={iterations}", f"rollout.batch_size={batch}", "algorithm.k=4", "eval.every=0",
            "cluster.env_workers=2"]  # fmt: skip
    proc = start_train(CONFIG, run_dir, *args, runner="tests.support.slow_pass_roles")
    trainer_log = run_dir / "logs" / f"trainer-{SLOW_POLICY}.log"
    try:
        child_pids(run_dir)
        deadline = time.monotonic() + 180
        slow = _wait_for(trainer_log, r"slow pass over groups \[([^\]]*)\]", deadline, proc)[0]
        computed = re.findall(r"'([^']+)'", slow.group(1))
        episode = computed[0].split("/")[0]  # (a group key is "<episode>/<agent>/<turn>")
        assert episode.startswith(f"train{SLOW_ITERATION}-"), computed
        took = rf"took groups \[([^\]]*)\] of episode {episode} \(attempt 0\)"
        while not any(set(re.findall(r"'([^']+)'", m.group(1))) - set(computed)
                      for m in _wait_for(trainer_log, took, deadline, proc)):  # fmt: skip
            time.sleep(0.02)  # the episode's next group has come: it waits for the slow pass
        workers = [p for p in (run_dir / "logs").glob("env_worker-*.log")
                   if f"running episode {episode} (attempt 0)" in p.read_text(errors="replace")]  # fmt: skip
        assert len(workers) == 1, workers
        name = "env_worker/" + workers[0].stem.split("-")[-1]
        pid = json.loads((run_dir / "pids.json").read_text())[name]
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out[-3000:]
    assert "restarting the run" not in out and out.count("started it again as pid") == 1
    rows = _rows(run_dir)
    _check_every_iteration_once(rows, iterations, batch)
    assert sum(r[Keys.restarts("env_worker")] for r in rows) == 1
    log = trainer_log.read_text(errors="replace")
    withdrew = re.search(
        rf"step from v{SLOW_ITERATION}: withdrew (\d+) samples of episode {episode} \(attempt 0\): (\d+) dropped "
        r"before a pass took them, (\d+) taken by a pass \(the step is computed again at its end\)", log
    )  # fmt: skip
    assert withdrew, log[-3000:]
    assert int(withdrew.group(2)) >= 4 and int(withdrew.group(3)) >= 4, withdrew.group(0)  # (a group: k = 4)
    rerun = [p for p in (run_dir / "logs").glob("env_worker-*.log")
             if f"running episode {episode} (attempt 1)" in p.read_text(errors="replace")]  # fmt: skip
    assert rerun, "the lost episode never ran again"
    assert re.search(rf"took groups \[[^\]]*\] of episode {episode} \(attempt 1\)", log)
    assert f"iteration {SLOW_ITERATION}: v{SLOW_ITERATION + 1}, " in log  # its step trained (Trained without error)
