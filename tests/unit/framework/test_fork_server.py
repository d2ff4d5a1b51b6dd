"""The fork server starts each process as a fork that imported torch already, in its own session, with the
requested environment, folder and log, and tells the launcher every exit status."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from mas_async.config import load_config
from mas_async.launch.engines.base import EngineError
from mas_async.launch.fork_server import ForkServer
from mas_async.launch.launcher import prepare_deployment, prepare_run_dir
from mas_async.runtime.actor import PARENT_PID_ENV
from tests.support.paths import ROOT

ROLES = "tests.support.fork_roles:ROLES"
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    config = load_config(ROOT / "configs/sokoban_tiny.yaml", [f"run.output_dir={tmp_path_factory.mktemp('run')}"])
    run_dir = prepare_run_dir(config)
    prepare_deployment(config, run_dir)
    return run_dir


@pytest.fixture(scope="module")
def server(run_dir):
    server = ForkServer("local", [], {"ONLY_IN_THE_SERVER": "1"}, run_dir / "logs" / "fork-server.log", TIMEOUT_S)
    yield server
    server.close()


def start(
    server: ForkServer, run_dir: Path, role: str, env: dict[str, str] | None = None, **options
) -> tuple[int, Path]:
    log = run_dir / "logs" / f"{role}-{time.monotonic_ns()}.log"
    argv = [role, str(run_dir), "--roles", ROLES, "--options", json.dumps(options)]
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), **(env or {})}
    return server.start(role, argv, env, log), log


def test_a_child_is_a_preloaded_fork_in_its_own_session_with_its_own_environment_folder_and_log(
    server, run_dir, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "facts.json"
    pid, log = start(server, run_dir, "probe", {"ASKED_FOR": "yes"}, out=str(out))
    assert server.wait(pid, TIMEOUT_S) == 0, log.read_text()
    facts = json.loads(out.read_text())
    assert facts["pid"] == pid
    assert facts["sid"] == pid and facts["pgid"] == pid  # its own session: stopping its group stops it all
    assert facts["ppid"] == server.proc.pid and facts["env"][PARENT_PID_ENV] == str(server.proc.pid)
    assert facts["torch_was_loaded"]  # imported once, by the server
    assert facts["env"]["ASKED_FOR"] == "yes" and "ONLY_IN_THE_SERVER" not in facts["env"]
    assert facts["cwd"] == str(tmp_path)
    assert facts["stdin"] == ""
    assert facts["cmdline"].startswith(f"{sys.executable} -m mas_async.launch.process probe {run_dir} --roles")
    text = log.read_text()
    assert "probe says hello" in text and "[probe/0] mas_async: probe/0 exited cleanly" in text


def test_every_exit_status_comes_back(server, run_dir):
    pid, _ = start(server, run_dir, "exit_with", code=3)
    assert server.wait(pid, TIMEOUT_S) == 3

    pid, log = start(server, run_dir, "crash")
    assert server.wait(pid, TIMEOUT_S) == 1
    assert "ValueError: the probe crashed on purpose" in log.read_text()

    pid, log = start(server, run_dir, "no_such_role")
    assert server.wait(pid, TIMEOUT_S) == 1
    assert "unknown role 'no_such_role'" in log.read_text()

    pid, _ = start(server, run_dir, "sleeper")
    assert server.wait(pid, 0.5) is None and server.returncode(pid) is None
    os.killpg(pid, signal.SIGKILL)
    assert server.wait(pid, TIMEOUT_S) == -signal.SIGKILL


def test_a_closed_server_exits_and_refuses_to_start_more(run_dir):
    server = ForkServer("node-x", [], {}, run_dir / "logs" / "fork-server-x.log", TIMEOUT_S)
    pid, _ = start(server, run_dir, "exit_with", code=0)
    assert server.wait(pid, TIMEOUT_S) == 0
    server.close()
    assert server.proc.returncode == 0
    with pytest.raises(EngineError, match="fork server of node node-x exited when starting probe"):
        start(server, run_dir, "probe", out="/dev/null")
