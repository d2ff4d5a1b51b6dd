"""An agent service outside the run makes every LLM call (nodes/examples/agent_service.py), through gateways
served on their node's address with the run's token (`gateway.external`), every role a real process.

The service is started here as a process of its own (not by the run) on this machine's non-loopback
address; the run's program only forwards each episode to it. `mas-async train` trains on its calls, strict
on-policy, and `mas-async bench` measures a rollout whose calls are all the service's. While the run is
up, requests without the run's token, with another one, and with the token but no open episode get
OpenAI's error objects, are counted, and change nothing; the gateway is not on loopback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.integration.launch import cleanup, start_train
from tests.support.addresses import accepts, node_address
from tests.support.paths import ROOT

CONFIG = "configs/examples/agent_service.yaml"
FAST = ["run.iterations=2", "rollout.batch_size=2", "algorithm.k=2", "eval.every=2", "eval.size=2"]
NODE = node_address()


@pytest.fixture
def service(tmp_path: Path) -> Iterator[str]:
    """The agent service as a process of its own on this machine's node address; its URL. Stopped by pid."""
    url_file = tmp_path / "service.url"
    log = (tmp_path / "service.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "nodes.examples.agent_service", "--host", str(NODE), "--port", "0",
         "--url-file", str(url_file)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not url_file.exists():
            assert proc.poll() is None, (tmp_path / "service.log").read_text()
            assert time.monotonic() < deadline, "the agent service did not start in 60 s"
            time.sleep(0.1)
        yield url_file.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()


def stats(service: str) -> dict[str, int]:
    return httpx.get(f"{service}/stats", timeout=10, trust_env=False).json()


def gateway_of(run_dir: Path, timeout_s: float = 120.0) -> str:
    """Env worker 0's gateway base URL from deployment.json, once it accepts connections."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        path = run_dir / "deployment.json"
        if path.exists():
            url = json.loads(path.read_text())["gateways"]["env_worker/0"]
            where = urlsplit(url)
            if accepts(str(where.hostname), int(where.port or 0)):
                return url
        time.sleep(0.2)
    raise TimeoutError(f"env worker 0's gateway never listened within {timeout_s}s")


def probe(url: str, run_dir: Path) -> None:
    """Requests the gateway refuses, each with OpenAI's error object; and no listener on loopback."""
    token = (run_dir / "keys" / "gateway_token").read_text().strip()
    body = {"model": "vertical", "messages": [{"role": "user", "content": "GO"}]}
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as http:
        for key, status, code in [
            (None, 401, "invalid_api_key"),  # no token: counted
            ("not-the-token.mas-x", 401, "invalid_api_key"),  # another token: counted
            (f"{token}.mas-no-such-episode", 404, "episode_not_found"),  # the token, no episode: not counted
        ]:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            response = http.post("/chat/completions", json=body, headers=headers)
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert error["code"] == code and error["message"] and error["type"] == "invalid_request_error"
    where = urlsplit(url)
    assert where.hostname == NODE and not accepts("127.0.0.1", int(where.port or 0))  # the node's address only


def calls_in(rows: list[dict], prefix: str, episodes: str) -> int:
    """The gateway calls of the rows' episodes: per-episode means of both agents times the episodes."""
    total = 0.0
    for row in rows:
        if episodes in row:
            total += sum(row[f"{prefix}gateway/calls/{agent}"] for agent in ("vertical", "horizontal")) * row[episodes]
    return round(total)


def test_a_run_trains_on_the_calls_of_an_agent_service_outside_it(tmp_path: Path, service: str) -> None:
    run_dir = tmp_path / "run"
    proc = start_train(
        CONFIG, run_dir, *FAST, f"cluster.host={NODE}", f"workflow.options.service_url={service}",
        "workflow.options.max_turns=3",
    )  # fmt: skip
    try:
        probe(gateway_of(run_dir), run_dir)
        out, _ = proc.communicate(timeout=400)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "policy/vertical/version" in r]
    assert len(train) == 2, rows
    for i, row in enumerate(train):
        assert row["rollout/dropped"] == 0 and row["rollout/episodes"] == 4  # 2 problems x K=2 episodes
        for policy in ("vertical", "horizontal"):
            assert row[f"policy/{policy}/version"] == i
            assert row[f"policy/{policy}/version_mismatch"] == 0
            assert row[f"policy/{policy}/samples"] > 0
            assert row[f"policy/{policy}/logprob_abs_diff"] < 1e-4
            # each call after an episode's first repeats its history: its ids are reused, none edited
            calls = row[f"gateway/calls/{policy}"]
            assert calls >= 1 and row[f"gateway/prefix_mismatch/{policy}"] == 0, row
            assert abs(row[f"gateway/reused/{policy}"] - (calls - 1)) < 1e-9, row
    evaluated = [r for r in rows if "eval/episodes" in r]
    assert evaluated and all(r["eval/dropped"] == 0 for r in evaluated)
    # Every call of every episode was the service's: the program made none of its own.
    seen = stats(service)
    episodes = sum(r["rollout/episodes"] for r in train) + sum(r["eval/episodes"] for r in evaluated)
    assert seen["failed"] == 0 and seen["episodes"] == episodes
    assert seen["calls"] == calls_in(train, "", "rollout/episodes") + calls_in(evaluated, "eval/", "eval/episodes")
    # The two requests without the run's token were counted; the one with it (no episode) was not.
    # (every row with episodes has the count: each external episode's summary carries its worker's refusals)
    with_episodes = [r for r in rows if "rollout/episodes" in r or "eval/episodes" in r]
    assert sum(r["gateway/refused_auth"] for r in with_episodes) == 2, rows
    deployment = json.loads((run_dir / "deployment.json").read_text())
    assert set(deployment["gateways"]) == {"env_worker/0", "env_worker/1"}
    assert all(urlsplit(u).hostname == NODE for u in deployment["gateways"].values())
    assert "refused a request from" in (run_dir / "logs" / "env_worker-0.log").read_text()


def test_bench_measures_a_rollout_whose_calls_come_from_the_service(tmp_path: Path, service: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mas_async", "bench", str(ROOT / CONFIG), f"run.output_dir={tmp_path / 'run'}",
         f"cluster.host={NODE}", f"workflow.options.service_url={service}", "workflow.options.max_turns=2",
         "rollout.batch_size=2", "algorithm.k=2", "--phases", "1", "--warmup", "0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (result,) = json.loads((tmp_path / "run" / "bench.json").read_text())["results"]
    total = result["total"]
    assert total["dropped"] == 0 and total["requests"] > 0 and total["episodes_per_s"] > 0
    # Each of the service's calls is one generate request, credited to its episode (so to the phase).
    seen = stats(service)
    assert seen["failed"] == 0 and seen["episodes"] == 4 and seen["calls"] == total["requests"]
    assert result["episode_time"]["waiting_for_generation_s"] > 0
