"""Every benchmark runs in its smoke mode (cleanrl style: the real script with a tiny budget) and prints
its figures and its ratio against the raw baseline measured in the same run."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bench.staleness import mas_sides, parse_args
from mas_async.router.loop_lag import OVER_MS
from mas_async.sandbox import isolation_available
from tests.support.paths import ROOT


def _run(script: str, tmp_path: Path, *extra: str) -> tuple[str, dict]:
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--smoke", "--json", str(out), *extra],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text())


def test_rollout_throughput_smoke(tmp_path: Path) -> None:
    stdout, figures = _run("rollout_throughput.py", tmp_path, "--curve-ratio")
    assert "overhead ratio" in stdout and "CURVE ratio" in stdout
    framework, standalone = figures["framework"], figures["standalone"]
    assert framework["tokens"] == standalone["tokens"] > 0  # the same prompts, exactly max_tokens each
    assert figures["curve"] is True and figures["framework_without_curve"]["tokens"] == framework["tokens"]
    medians = [statistics.median(f["phase_tokens_per_s"]) for f in (framework, figures["framework_without_curve"])]
    assert figures["curve_ratio"] == pytest.approx(medians[0] / medians[1])
    assert framework["dropped"] == 0 and 0 < framework["busy_fraction"] <= 1.0
    assert figures["overhead_ratio"] > 0


def test_weight_sync_smoke(tmp_path: Path) -> None:
    stdout, figures = _run("weight_sync.py", tmp_path)  # the smoke run also checks the loaded weights
    assert "weight sync ratio" in stdout
    assert len(figures["sizes"]) == 2 and figures["worst_ratio"] > 0
    stdout, _ = _run("weight_sync.py", tmp_path, "--copy")  # the copying path checks its weights too
    assert "copying path" in stdout


def test_router_smoke(tmp_path: Path) -> None:
    stdout, figures = _run("router.py", tmp_path)
    assert "router ratio" in stdout
    rates = figures["rates"]
    assert rates["raw"][0] > 0 and rates["raw-sync"][0] > 0 and rates["router"][0] > 0
    assert figures["baseline"] in ("raw", "raw-sync") and figures["ratio"] > 0
    assert "CURVE ratio" in stdout and rates["router-curve"][0] > 0 and figures["curve_ratio"] > 0
    # CPU per request of the middle and of every process of the run (what a shared machine's load moves least).
    every = figures["cpu_us_all_processes"]
    assert all(every[m][0] > figures["cpu_us"][m][0] > 0 for m in ("raw", "raw-sync", "router", "router-curve"))
    assert figures["all_processes_cpu_ratio"] > 0 and "router CPU ratio, every process" in stdout
    # Per role: CPU and the main threads' voluntary context switches per request (how often each slept).
    assert "per request, by role" in stdout
    for middle in ("raw", "raw-sync", "router", "router-curve"):
        (roles,) = figures["per_role"][middle]
        assert set(roles) == {"middle", "clients", "servers"}
        assert all(cpu_us > 0 and switches >= 0 for cpu_us, switches in roles.values()), roles


def test_router_smoke_of_some_middles_shows_only_those(tmp_path: Path) -> None:
    """A middle left out (`--middles`) is absent from the output and the figures, never 0 requests/s or inf us;
    a ratio whose sides were not both measured is absent too."""
    stdout, figures = _run("router.py", tmp_path, "--middles", "raw-sync", "router")
    assert set(figures["rates"]) == set(figures["per_role"]) == {"raw-sync", "router"}
    assert figures["baseline"] == "raw-sync" and figures["ratio"] > 0 and figures["curve_ratio"] is None
    assert "inf us" not in stdout and " 0 requests/s" not in stdout and "CURVE" not in stdout
    assert "uvloop + zmq.asyncio" not in stdout and "blocking loop" in stdout
    stdout, figures = _run("router.py", tmp_path, "--middles", "router")  # no baseline: no ratio
    assert figures["baseline"] is None and figures["ratio"] is None and "router ratio" not in stdout


def test_gpu_check_smoke(tmp_path: Path) -> None:
    """The GPU check's CPU rehearsal: hf server and trainer, a step, the versioned update over gloo and the
    log-prob match, in full and with LoRA adapters; the CUDA IPC part says it is skipped; 1 against 2 trainer ranks
    (and ZeRO) make one update; the demo learns for 2 iterations through
    `mas-async train` on the CPU (gloo)."""
    stdout, figures = _run("gpu_check.py", tmp_path)
    assert stdout.startswith("vLLM: ") and "CUDA IPC: skipped" in stdout
    assert figures["passed"] and figures["device"] == "cpu" and not figures["errors"]
    run = figures["passes"]["float32"]
    assert run["logprob"]["mean_abs_diff"] < 1e-4 < run["logprob"]["step_moved"]
    assert run["rollout"]["tokens"] > 0 and run["train_step"]["tokens_per_s"] > 0 and run["gloo_sync"]["ratio"] > 0
    lora = figures["passes"]["float32+lora"]  # adapters only: a fraction of the bytes, the same match
    assert lora["logprob"]["mean_abs_diff"] < 1e-4 < lora["logprob"]["step_moved"]
    assert 0 < lora["bytes"] < 0.5 * run["bytes"] and lora["of_full_model"] < 0.5 and run["of_full_model"] == 1.0
    ranks = figures["ranks"]["settings"]  # over gloo here; rank r on cuda:r over NCCL on a 2-GPU machine
    assert set(ranks) == {"1 rank", "2 ranks", "2 ranks + ZeRO"} and all(r["samples_per_s"] > 0 for r in ranks.values())
    assert max(r["parameter_norm_drift"] for r in ranks.values()) < 1e-6
    full = ranks["2 ranks"]["optimizer_state_mb"]
    assert full == ranks["1 rank"]["optimizer_state_mb"]  # plain data parallel: the whole state on each rank
    assert 0.4 * full < ranks["2 ranks + ZeRO"]["optimizer_state_mb"] < 0.6 * full  # ZeRO over 2: about half each
    demo = figures["demo"]
    assert demo["iterations"] == 2 and demo["returncode"] == 0 and demo["wall_s"] > 0
    assert demo["weight_backends"] == {"vertical": "gloo", "horizontal": "gloo"} and demo["version_mismatch_max"] == 0


def test_gpu_step_check_smoke(tmp_path: Path) -> None:
    """The real-sized step's device check rehearsed on the CPU: a step of a tiny Qwen3 shape, changed_fraction
    with and without the float32 master, the send to another process and a stalled send's named error."""
    stdout, figures = _run("gpu_step_check.py", tmp_path)
    assert all(figures["checks"].values()) and len(figures["checks"]) == 6, figures["checks"]
    assert figures["step"]["samples"] == 8 and figures["step"]["tokens_per_s"] > 0
    assert figures["precision"]["float32"] >= 0.9 > 0.1 > figures["precision"]["bfloat16"]
    assert figures["broadcast"]["backend"] == "gloo" and figures["broadcast"]["seconds"] > 0
    assert "did not complete within" in figures["broadcast"]["stall"]["error"]


def test_staleness_tail_threads_give_one_streamed_side_each_and_bad_values_are_refused() -> None:
    """`--tail-threads 2,1`: the A/B of a streamed step's tail, a streamed side for each value (the leases side
    takes the first); a value that is not a whole number, below 1 or repeated is refused by name."""
    sides = mas_sides(parse_args(["--tail-threads", "2,1", "--staleness", "0,1"]))
    assert [(s.name, s.streaming, s.leases, s.tail_threads) for s in sides] == [
        ("k=0", False, False, None),
        ("k=0 streaming", True, False, 2),
        ("k=0 streaming, tail 1", True, False, 1),
        ("k=0 streaming, leases", True, True, 2),
        ("k=1", False, False, None),
    ]
    for bad in ("x", "1,1", "0"):
        with pytest.raises(SystemExit) as refused:
            parse_args(["--tail-threads", bad])
        assert refused.value.code == 2, bad


def test_staleness_smoke(tmp_path: Path) -> None:
    """Training deployments with k = 0 (the batch step, the streamed one, and the streamed one with leases) and 1
    against the lockstep pattern on the same code episodes, lockstep's step run (not costed): the figures are there
    and sane (no timing targets), the stale run stays within its window, the streamed one has its phase times, and
    every side is set against the overlap bound."""
    stdout, figures = _run("staleness.py", tmp_path)
    assert "ratios (tokens/s against lockstep)" in stdout and "a trainer on its own device" in stdout
    sides = figures["sides"]
    assert set(sides) == {"lockstep", "k=0", "k=0 streaming", "k=0 streaming, leases", "k=1"}
    assert set(figures["ratios"]) == {"k=0", "k=0 streaming", "k=0 streaming, leases", "k=1"}
    assert figures["same_episodes"]
    cores = len(os.sched_getaffinity(0))
    assert sides["lockstep"]["step"] == "run" and sides["lockstep"]["torch_threads"] == cores
    assert sides["k=0"]["torch_threads"] == cores and sides["k=0 streaming"]["torch_threads"] == 1
    assert sides["k=0 streaming"]["tail_threads"] == sides["k=0 streaming, leases"]["tail_threads"] == cores
    assert "tail_threads" not in sides["k=0"] and "tail_threads" not in sides["k=1"]
    assert sides["k=0 streaming"]["streams_turns"] and not sides["k=0 streaming, leases"]["streams_turns"]
    for name, side in sides.items():
        assert side["step"] == "run" and side["measured_iterations"] == 1 and side["window_s"] > 0, name
        assert side["iterations"] == 1 and side["episodes"] == 2 and side["dropped"] == 0, name
        assert side["tokens"] == sides["lockstep"]["tokens"] > 0, name  # the same scripted answers
        assert side["seconds"] > 0 and side["tokens_per_s"] > 0 and side["iterations_per_min"] > 0, name
        assert 0.0 <= side["trainer_idle_fraction"] <= 1.01 and 0.0 <= side["inference_idle_fraction"] <= 1.01, name
    assert sides["k=0"]["staleness_max"] == 0 and sides["k=0 streaming"]["staleness_max"] == 0
    assert sides["k=0"]["overlap"] == 0.0  # the batch step computes nothing before its last group
    streamed = sides["k=0 streaming"]
    assert 0.0 <= streamed["overlap"] <= 1.0 and streamed["compute_s"] > 0 and streamed["tail_s"] > 0
    assert figures["own_device_estimate"]["ratio"] > 0
    # What bounded the overlap, measured by the trainer: the share of samples ready before the last group.
    assert 0.0 <= streamed["ready_early"] <= 1.0 and streamed["ready_lead_s"] >= 0.0
    assert "what the rule allows" in stdout and figures["own_device_estimate"]["bound_ratio"] > 0
    assert sides["k=1"]["staleness_max"] <= 1 and sides["k=1"]["stale_dropped"] == 0
    assert all(ratio > 0 for ratio in figures["ratios"].values())
    # The overlap bound: lockstep's measured rollout and step, perfectly overlapped; each side as a share of it.
    bound = figures["overlap_bound"]
    lockstep = sides["lockstep"]
    expected = (lockstep["seconds"] / lockstep["iterations"]) / max(lockstep["rollout_s"], lockstep["step_phase_s"])
    assert bound["ratio"] == pytest.approx(expected) and "overlap bound" in stdout
    assert set(bound["of_bound"]) == set(figures["ratios"])
    assert bound["of_bound"]["k=1"] == pytest.approx(figures["ratios"]["k=1"] / bound["ratio"])
    # The machine's CPU over each side's window, and what its cores allow the streamed step.
    machine = figures["machine_bound"]
    assert machine["cores"] == len(os.sched_getaffinity(0)) and set(machine["sides"]) == set(sides)
    for name, cpu in machine["sides"].items():
        assert cpu["cpu_s_per_iteration"] > 0 and 0.0 < cpu["busy"] <= 1.05, name
    packed = machine["sides"]["k=0 streaming"]["cpu_s_per_iteration"] / machine["cores"]
    assert machine["packed_seconds_per_iteration"] == pytest.approx(packed)
    lockstep = sides["lockstep"]["seconds"] / sides["lockstep"]["iterations"]
    assert machine["ratio_bound"] == pytest.approx(lockstep / packed) and "what this machine's cores allow" in stdout


def test_gateway_smoke(tmp_path: Path) -> None:
    """The movers through the OpenAI-compatible gateway (the `openai` package's clients, in-process and over
    HTTP) against the same workflow as node classes, all on the mock backend: every side played episodes,
    the ratios are theirs."""
    stdout, figures = _run("gateway.py", tmp_path)
    assert "ratio gateway / node classes" in stdout and "ratio gateway over HTTP / node classes" in stdout
    (sides,) = figures["rounds"]
    for name in ("gateway", "gateway over HTTP", "node classes"):
        assert sides[name]["requests_per_s"] > 0 and sides[name]["episodes_per_s"] > 0, name
        assert sides[name]["requests_per_episode"] >= 1 and sides[name]["dropped"] == 0, name
    nodes = sides["node classes"]
    assert figures["ratios"] == [sides["gateway"]["requests_per_s"] / nodes["requests_per_s"]]
    assert figures["http_ratios"] == [sides["gateway over HTTP"]["requests_per_s"] / nodes["requests_per_s"]]
    # The machine's CPU per request on each side, and the openai client's own share of the HTTP side's.
    node, gateway = nodes["cpu_ms_per_request"], sides["gateway"]["cpu_ms_per_request"]
    http = sides["gateway over HTTP"]["cpu_ms_per_request"]
    assert node > 0 and gateway > 0 and figures["cpu_ratios"] == [node / gateway]
    assert figures["http_cpu_ratios"] == [node / http]
    (client,) = figures["client_ms_per_call"]
    assert 0 < client < http and client == sides["openai client alone"]["cpu_ms_per_request"]
    assert "the openai client's own work alone" in stdout
    assert figures["client_bounds"] == [pytest.approx(node / (node + client))]


def test_faults_smoke(tmp_path: Path) -> None:
    """An env worker SIGKILLed in a real run, and a replica then its replacement while it loads: their
    recoveries are in the run's metrics, short, nothing redone (the whole-run restarts of the other kinds:
    tests/integration/test_faults.py); a replacement slower than the weight-sync bound while the run steps."""
    stdout, figures = _run("faults.py", tmp_path)
    assert "recovery per kind of fault" in stdout and "slow replacement" in stdout
    assert set(figures["recovery_s"]) == {"env_worker", "inference_loading"}
    for kind, found in figures["recovery_s"].items():
        assert len(found) == 1 and 0 < found[0] < 30, kind
        assert figures["redone"][kind] == 0  # replaced alone: nothing runs twice
    slow = figures["slow_replacement"]
    assert len(slow["ratios"]) == 1 and slow["while_loading"][0] > 0 and slow["before"][0] > 0


def test_trainer_scaling_smoke(tmp_path: Path) -> None:
    """1 rank and 1 rank with LoRA on the same batch (the smoke's; 2 ranks and ZeRO through the same `measure`:
    test_gpu_check_smoke): a rate each, LoRA's optimiser state a fraction of the full model's; a LoRA sync sends
    a fraction of the full model's bytes."""
    stdout, figures = _run("trainer_scaling.py", tmp_path)
    settings = figures["settings"]
    assert set(settings) == {"1 rank", "1 rank + LoRA"} and "| 1 rank + LoRA |" in stdout
    assert all(s["samples_per_s"][0] > 0 and s["vs_1_rank"][0] > 0 for s in settings.values())
    assert settings["1 rank"]["vs_1_rank"] == [1.0]
    one = settings["1 rank"]["optimizer_state_mb"]
    assert 0 < settings["1 rank + LoRA"]["optimizer_state_mb"] < 0.5 * one
    full, lora = figures["sync"].values()
    assert full["fraction"] == 1.0 and 0 < lora["fraction"] < 0.5 and lora["bytes"] < full["bytes"]
    assert all(s > 0 for s in full["seconds"] + lora["seconds"])


def test_trainer_logprobs_smoke(tmp_path: Path) -> None:
    """The masked baseline, the unmasked batch and the shared-prompt passes: a time each, the same
    log-probs; learner steps with the old log-probs recomputed and from the training pass: the same weights."""
    stdout, figures = _run("trainer_logprobs.py", tmp_path)
    ways = figures["ways"]
    assert set(ways) == {"baseline", "unmasked", "shared"} and "speedup vs baseline" in stdout
    assert all(len(w["seconds"]) == 1 and w["seconds"][0] > 0 for w in ways.values())
    assert ways["baseline"]["speedup"] == [1.0]
    assert ways["unmasked"]["max_abs_diff"] < 1e-5 and ways["shared"]["max_abs_diff"] < 1e-5
    steps = figures["learner_steps"]  # the old log-probs recomputed, and from the training pass
    assert all(len(s) == 1 and s[0] > 0 for s in steps["seconds"].values()) and len(steps["speedup"]) == 1
    assert steps["weight_drift"] < 1e-5 and "from the training pass" in stdout


def test_train_memory_smoke(tmp_path: Path) -> None:
    """One training step per completion length, each in a fresh process: the peak it adds over what the
    process held before, as a list of {"tokens", "peak_bytes"}, and the difference between the lengths."""
    stdout, figures = _run("train_memory.py", tmp_path)
    assert [f["tokens"] for f in figures] == [16, 256] and all(f["peak_bytes"] > 0 for f in figures)
    assert all(len(f["runs"]) == 1 and f["runs"][0]["micro_batches"] >= 1 for f in figures)
    assert "peak(256) - peak(16)" in stdout


def test_prompt_prefix_smoke(tmp_path: Path) -> None:
    """Rollout and trainer, each with and without the prompts' common first part read once: a ratio
    each, and the same log-probs."""
    stdout, figures = _run("prompt_prefix.py", tmp_path)
    assert set(figures["ratios"]) == {"rollout", "trainer"} and "of the baseline" in stdout
    assert all(len(r) == 1 and r[0] > 0 for r in figures["ratios"].values())
    assert figures["max_abs_diff"] < 1e-5  # the same log-probs (bitwise equal on some CPUs)
    # Both ways ran, on different passes: the common first part was read once only by ours.
    assert figures["prefix_reads"]["baseline"] == 0 < figures["prefix_reads"]["ours"]


def test_shared_base_smoke(tmp_path: Path) -> None:
    """The shared-base arm and its role-swap probe: one inference process, both probes evaluated."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "shared_base.py"), "--smoke", "--arms", "shared", "--out", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run,) = json.loads((tmp_path / "shared_base.json").read_text())["shared base"]["runs"]
    assert run["inference"] == ["inference/horizontal/0"]
    assert set(run["probe"]) == {"as trained", "roles swapped"}
    assert all(0.0 <= v <= 1.0 for v in run["probe"].values())
    assert run["worst"]["vertical/version_mismatch"] == 0 and run["worst"]["vertical/logprob_abs_diff"] < 1e-4
    assert (tmp_path / "shared-seed0-swapped" / "eval.json").is_file() and (tmp_path / "shared_base.png").is_file()
    assert "role-swap probe" in proc.stdout


@pytest.mark.skipif(not isolation_available(), reason="bubblewrap cannot isolate runs here")
def test_sandbox_start_smoke(tmp_path: Path) -> None:
    """Both ways of starting an isolated run and the bare baseline, on both programs: a CPU cost and a
    rate each, the ratios and what bubblewrap costs."""
    stdout, figures = _run("sandbox_start.py", tmp_path)
    assert set(figures) == {"trivial", "function tests", "background_cpu_per_s"}
    assert "zygote ratio, function tests" in stdout and figures["background_cpu_per_s"] >= 0
    for ways in (figures["trivial"], figures["function tests"]):
        assert all(
            len(ways[w][f]) == 1 and ways[w][f][0] > 0
            for w in ("zygote", "fresh", "bare")
            for f in ("cpu_ms", "runs_per_s")
        )
        assert ways["cpu_ratio"] == [ways["fresh"]["cpu_ms"][0] / ways["zygote"]["cpu_ms"][0]]
        assert ways["bwrap_cpu_ms"] == [ways["fresh"]["cpu_ms"][0] - ways["bare"]["cpu_ms"][0]]


def test_scale_smoke(tmp_path: Path) -> None:
    """The control plane's scale simulator: the real router process against simulated replicas, env
    workers and trainer, and figures that come from real measurements."""
    # (iterations of 8 episodes at both loads: the deployment check may read the router's CPU as a line)
    stdout, figures = _run("scale.py", tmp_path, "--plot", str(tmp_path / "scale.png"), "--iteration-episodes", "8")
    assert "deployment: 1024 GPUs" in stdout and "requests/s" in stdout
    points = figures["points"]
    assert len(points) == 2
    for point in points:
        # With leases (the bench's default) every request went straight to a leased replica, none via the router.
        assert point["direct_fraction"] == 1.0
        # Requests were answered within the window, and the router worked for the episodes.
        assert point["requests"] > 0 and point["rps"] > 0
        assert point["router_cpu_s"] > 0 and point["router_cpu_us_per_request"] > 0
        # Added latency is measured per request: end-to-end minus the replica's own service time.
        assert point["added_p99_ms"] >= point["added_p50_ms"] > 0
        assert point["e2e_p50_ms"] > point["service_p50_ms"] > 0
        assert math.isclose(point["service_p50_ms"], figures["service_ms"], rel_tol=0.2)
        # Episodes finished: their groups reached the simulated trainer, which stepped with the count the
        # router said it forwarded.
        assert point["samples_per_s"] > 0 and point["steps"] > 0
        assert point["sample_mismatches"] == 0 and point["errors"] == 0
        assert point["router_rss_mb"] > 0
        # The router's own loop lag, from its metrics rows written in the window (router/loop_lag.py).
        assert point["router_lag_rows"] > 0 and 0 <= point["router_lag_p99_ms"] <= point["router_lag_max_ms"]
        # Over all the window's ticks: the p99's bound is the least lag at most 1% of them ran over.
        over = point["router_lag_share_over_ms"]
        assert point["router_lag_ticks"] > 0 and list(over.values()) == sorted(over.values(), reverse=True)
        bound = point["router_lag_p99_bound_ms"]
        assert bound is None or (
            over[f"{bound:g}"] <= 0.01 and all(over[f"{ms:g}"] > 0.01 for ms in OVER_MS if ms < bound)
        )
        assert point["router_on_cores"] == sorted(os.sched_getaffinity(0))  # (no --router-core: not pinned)
    # Twice the offered load gives more requests through the router (these loads are far below saturation).
    low, high = sorted(points, key=lambda p: p["offered_rps"])
    assert high["rps"] > 1.3 * low["rps"]
    check = figures["deployment"]
    assert check["rate_rps"] == 1024 * 3000 / (100 * 4)  # the smoke run keeps the checked deployment's knobs
    assert check["router_cores"] > 0 and check["max_gpus_one_core"] > 0
    # With leases the router's load is in episodes: the deployment's 7,680 requests/s in 2-turn episodes (the
    # smoke's turns), far above what 6 replicas reach, so its CPU there comes from the loads measured.
    assert check["unit"] == "episode" and check["load"] == check["rate_rps"] / 2 and check["measured_at_load"] is None
    if check["fixed_cores"] is not None:  # the line through the two loads
        expected = check["fixed_cores"] + check["marginal_us_per_unit"] / 1e6 * check["load"]
        assert check["fit_loads"] == 2 and math.isclose(check["router_cores"], expected)
        assert all(p["batch_size"] == 8 for p in points)
        assert "cores fixed +" in stdout
    else:  # (a noisy pair of loads: each cost counted per episode)
        assert check["no_fit"] == "a negative fixed or marginal cost"
        assert math.isclose(check["router_cores"], check["cores_per_unit_bound"])
    # The router's own delay, at the point of the most episodes/s: its own work is part of its loop's lag.
    assert 0 <= check["router_work_lag_p99_ms"] <= check["router_lag_p99_ms"]
    assert check["router_lag_at_load"] == max(p["episodes_per_s"] for p in points)
    assert (tmp_path / "scale.png").stat().st_size > 0
    # What messages wait in the router, from when each was due: the ping peer's round trip (every ping answered),
    # EpisodeDone to the next RunEpisode where the router had an episode to give, a step's UpdateWeights to every
    # replica's WeightsLoaded; the line at the deployment check's point.
    assert "\nmessage delay through the router (at " in stdout
    for point in points:
        ping, fanout = point["message_delay"]["ping"], point["message_delay"]["fanout"]
        assert ping["n"] > 0 and ping["lost"] == 0 and 0 < ping["p50_ms"] <= ping["p99_ms"] <= ping["max_ms"]
        assert fanout["n"] > 0 and 0 < fanout["p50_ms"] <= fanout["max_ms"]
    assert sum(p["message_delay"]["dispatch"]["n"] for p in points) > 0
    assert sum(p["message_delay"]["probe"]["n"] for p in points) > 0  # (the probe worker ran episodes too)
    top = max(points, key=lambda p: p["episodes_per_s"])
    assert check["message_delay"] == top["message_delay"]
    # The probe runs at real-time priority where this user may set it (root), and the line says which it had.
    may = subprocess.run(
        [sys.executable, "-c", "import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))"],
        capture_output=True,
    )
    expected = "SCHED_FIFO" if may.returncode == 0 else "normal"
    assert {p["ping_priority"] for p in points} == {expected} and check["ping_priority"] == expected
    assert f"the probe at {'real-time (SCHED_FIFO)' if expected == 'SCHED_FIFO' else 'normal'} priority" in stdout


def test_scale_smoke_without_leases(tmp_path: Path) -> None:
    """`--no-leases`: every request through the router; `--router-core 0`: every thread of the router on core 0
    alone (on a machine of one core the bench refuses it, naming the cores it may use)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the router's core of its own needs a second core for the simulators")
    stdout, figures = _run("scale.py", tmp_path, "--no-leases", "--router-core", "0", "--ping-priority", "normal")
    assert "on core 0 alone" in stdout and "the router alone on core 0" in stdout
    assert "the probe at normal priority" in stdout  # (left at the simulators' when asked, root or not)
    for point in figures["points"]:
        assert point["router_on_cores"] == [0] and point["ping_priority"] == "normal"
        assert point["direct_fraction"] == 0.0
        assert point["requests"] > 0 and point["sample_mismatches"] == 0 and point["errors"] == 0


def test_router_refill_smoke(tmp_path: Path) -> None:
    """The router per finished episode at each worker count, and each against the fewest workers'."""
    stdout, figures = _run("router_refill.py", tmp_path)
    assert "us (" in stdout and "x of 4 workers'" in stdout
    rows = figures["workers"]
    assert set(rows) == {"4", "64"} and all(row["us_per_episode"] > 0 for row in rows.values())
    assert rows["4"]["ratio_to_fewest"] == 1.0 and rows["64"]["ratio_to_fewest"] > 0


def test_soak_smoke(tmp_path: Path) -> None:
    """A minute of the demo under kills (env workers and replicas every 12 s, a trainer and the router once):
    each role's growth figures, the run directory's by part, and the run's own checks, all passing; then the run,
    asked to stop at a checkpoint, ends by itself."""
    stdout, figures = _run("soak.py", tmp_path, str(ROOT / "configs/plan_path_tiny.yaml"))
    assert "soak of configs/plan_path_tiny.yaml" in stdout and "checks:" in stdout
    killed = {kill["name"].split("/")[0] for kill in figures["kills"]}
    assert {"trainer", "router"} <= killed and killed & {"env_worker", "inference"}, figures["kills"]
    assert {"router", "env_worker", "inference", "trainer"} <= set(figures["growth"]), figures["growth"]
    for role, growth in figures["growth"].items():
        assert growth["processes"] >= 1 and growth["fds_range"][0] > 0, role
    # The trainers' RSS split by where it lies, each sample's parts within its RSS (shared file pages are counted
    # in both), the heap and the file mappings never empty in a live python process.
    assert set(figures["growth"]["trainer"]["rss_parts_mb_per_h"]) == {"heap", "arenas", "anon", "file"}
    trainer = next(s for s in figures["samples"] if s["role"] == "trainer")
    for (t, rss, _, _), (t_parts, parts) in zip(trainer["samples"], trainer["parts"], strict=True):
        assert t == t_parts and parts["heap"] > 0 and parts["file"] > 0, parts
        assert 0.9 * rss <= sum(parts.values()) <= 1.1 * rss, (rss, parts)
    assert all("parts" not in s for s in figures["samples"] if s["role"] == "env_worker")
    assert {"checkpoints", "logs", "metrics.jsonl"} <= set(figures["dir_bytes_per_iteration"])
    checks = figures["checks"]
    assert checks["every_iteration_once"] and checks["version_mismatch_zero"] and checks["no_episode_uncounted"]
    assert checks["restarts"]["trainer"] >= 1 and checks["restarts"]["router"] >= 1, checks
    # Its end: asked to stop at a checkpoint, the launcher exits by itself, with status 0.
    assert checks["finished_by_itself"] and checks["exit_status"] == 0, checks
