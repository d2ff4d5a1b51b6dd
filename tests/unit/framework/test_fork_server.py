"""The fork server starts each process as a fork that imported torch already, in its own session, with the
requested environment, folder and log, and tells the launcher every exit status; a preloaded template forks
such a server per launcher that matches it, which ends with the launcher's connection."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from mas_async.config import load_config
from mas_async.launch import fork_template
from mas_async.launch.engines.base import EngineError
from mas_async.launch.fork_server import ForkServer
from mas_async.launch.fork_template import TEMPLATE_ENV
from mas_async.launch.launcher import prepare_deployment, prepare_run_dir
from mas_async.runtime.actor import PARENT_PID_ENV
from tests.support.paths import ROOT

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run one at a time (make test)

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
    server = ForkServer.spawn("local", [], {"ONLY_IN_THE_SERVER": "1"}, run_dir / "logs" / "fork-server.log", TIMEOUT_S)
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
    assert facts["ppid"] == server.pid and facts["env"][PARENT_PID_ENV] == str(server.pid)
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
    server = ForkServer.spawn("node-x", [], {}, run_dir / "logs" / "fork-server-x.log", TIMEOUT_S)
    pid, _ = start(server, run_dir, "exit_with", code=0)
    assert server.wait(pid, TIMEOUT_S) == 0
    server.close()
    assert server.proc.returncode == 0
    with pytest.raises(EngineError, match="fork server of node node-x exited when starting probe"):
        start(server, run_dir, "probe", out="/dev/null")


# -- the preloaded template (`fork_template.py`) ----------------------------------------------------


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A template of this test's own, on a socket this module alone uses; waits until it preloaded."""
    path = tmp_path_factory.mktemp("template") / "t.sock"
    proc = subprocess.Popen([sys.executable, "-m", "mas_async.launch.fork_template", str(path)], cwd=ROOT)
    deadline = time.monotonic() + TIMEOUT_S
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the template did not come up"
        time.sleep(0.1)
    yield proc, path
    proc.kill()
    proc.wait(timeout=30)


def test_a_template_forks_a_server_per_launcher_that_ends_with_its_connection(template, run_dir, monkeypatch, tmp_path):
    proc, path = template
    monkeypatch.setenv(TEMPLATE_ENV, str(path))
    # a roles module that only the launcher's sys.path finds: the server takes the launcher's sys.path
    (tmp_path / "roles_beside_the_launcher.py").write_text("from tests.support.fork_roles import ROLES\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    log = run_dir / "logs" / "fork-server-from-template.log"
    server = fork_template.connect("local", log, TIMEOUT_S)
    assert server is not None and server.proc is None
    assert psutil.Process(server.pid).ppid() == proc.pid  # a fork of the template, not a new interpreter
    out = run_dir / "facts-template.json"
    pid, child_log = start(server, run_dir, "probe", out=str(out))
    assert server.wait(pid, TIMEOUT_S) == 0, child_log.read_text()
    facts = json.loads(out.read_text())
    assert facts["torch_was_loaded"] and facts["ppid"] == server.pid == int(facts["env"][PARENT_PID_ENV])
    assert facts["sid"] == pid and facts["cwd"] == str(tmp_path)
    argv = ["exit_with", str(run_dir), "--roles", "roles_beside_the_launcher:ROLES", "--options", '{"code": 4}']
    pid = server.start("exit_with", argv, {"PATH": os.environ["PATH"]}, run_dir / "logs" / "exit-with-4.log")
    assert server.wait(pid, TIMEOUT_S) == 4, (run_dir / "logs" / "exit-with-4.log").read_text()
    assert log.exists()
    began = time.monotonic()
    server.close(timeout_s=60.0)  # the server ends by itself on EOF; only one that does not is killed at 60 s
    assert time.monotonic() - began < 30.0
    _gone_within(server.pid, 10.0)


def test_a_killed_launcher_ends_its_server_from_the_template(template, run_dir):
    proc, path = template
    code = (
        "import sys, time; from pathlib import Path; from mas_async.launch import fork_template; "
        f"s = fork_template.connect('local', Path({str(run_dir / 'logs' / 'killed.log')!r}), 60.0); "
        "print(s.pid, flush=True); time.sleep(600)"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, TEMPLATE_ENV: str(path)},
    )
    try:
        server_pid = int(launcher.stdout.readline())  # type: ignore[union-attr]
        assert psutil.Process(server_pid).ppid() == proc.pid
        launcher.kill()  # SIGKILL: the connection closes with the process
        _gone_within(server_pid, 10.0)
    finally:
        launcher.kill()
        launcher.wait(timeout=30)


def test_a_launcher_the_template_does_not_match_starts_its_own_server(template, run_dir, monkeypatch, tmp_path):
    _, path = template
    log = run_dir / "logs" / "no-template.log"
    monkeypatch.setenv(TEMPLATE_ENV, str(tmp_path / "nothing-listens-here.sock"))
    assert fork_template.connect("local", log, TIMEOUT_S) is None
    monkeypatch.setenv(TEMPLATE_ENV, str(path))
    with monkeypatch.context() as m:
        m.setattr(sys, "executable", "/usr/bin/another-python")
        assert fork_template.connect("local", log, TIMEOUT_S) is None
    # a preloaded package that this launcher would import from another file
    (tmp_path / "uvloop").mkdir()
    (tmp_path / "uvloop" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "uvloop", raising=False)
    assert fork_template.connect("local", log, TIMEOUT_S) is None


def _gone_within(pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.1)


# -- who may reach a template and whom a server signals -----------------------------------------------


def test_signals_to_a_child_on_a_prefixed_node_go_through_its_server(run_dir, monkeypatch):
    """A node reached by a command prefix has pids of its own: stopping a forked child there must not
    `killpg` that pid on the launcher's machine. The server, on the node, signals the child's group; it
    refuses a pid it did not start."""
    from mas_async.launch.engines.base import Node
    from mas_async.launch.engines.local import ForkedChild

    server = ForkServer.spawn("far", ["env"], {}, run_dir / "logs" / "fork-server-far.log", TIMEOUT_S)
    # (it outlives the test on a loaded machine too, where the server alone can take a minute to start; killed below)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)"], start_new_session=True)
    try:
        assert not server.local
        pid, log = start(server, run_dir, "sleeper")
        child = ForkedChild("sleeper", Node("far", "127.0.0.1"), log, server, pid)
        here: list[tuple[int, int]] = []
        monkeypatch.setattr(os, "killpg", lambda p, s: here.append((p, s)))  # nothing may be signalled here
        child.terminate()
        assert child.wait(TIMEOUT_S) == -signal.SIGTERM
        server.signal(stranger.pid, signal.SIGKILL)  # not one of its children: refused
        monkeypatch.undo()
        assert here == []
        time.sleep(0.5)
        assert stranger.poll() is None
        deadline = time.monotonic() + TIMEOUT_S
        log_text = ""
        while "refused to signal pid" not in log_text and time.monotonic() < deadline:
            log_text = server.log_path.read_text()
            time.sleep(0.05)
        assert f"refused to signal pid {stranger.pid}" in log_text
    finally:
        stranger.kill()
        stranger.wait(10)
        server.close()


def test_a_template_listens_in_a_private_folder_and_only_to_its_own_user(tmp_path):
    """The socket is 0600 in a 0700 folder; a template asked to listen in a folder others can enter refuses
    with a sentence; a process of another uid that reaches the socket anyway (here: the folder opened up by
    hand) is closed on before it can send a hello, and counted in the template's log."""
    open_folder = tmp_path / "open"
    open_folder.mkdir(mode=0o755)
    open_folder.chmod(0o755)
    out = subprocess.run(
        [sys.executable, "-m", "mas_async.launch.fork_template", str(open_folder / "t.sock")],
        cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert out.returncode == 2 and "a folder only its user can enter" in out.stderr and "mode 755" in out.stderr
    if os.geteuid() != 0:
        pytest.skip("the uid check needs a process of another uid (root makes one)")
    reachable = Path(tempfile.mkdtemp(prefix="mas-async-template-"))  # (pytest's own folders are root's, 0700)
    folder = reachable / "private"
    path = folder / "t.sock"
    log = tmp_path / "template.log"
    with log.open("ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mas_async.launch.fork_template", str(path)], cwd=ROOT, stderr=log_file
        )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not path.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert folder.stat().st_mode & 0o777 == 0o700 and path.stat().st_mode & 0o777 == 0o600
        for opened in (reachable, folder):
            opened.chmod(0o755)
        path.chmod(0o666)
        code = (
            "import os, socket, sys; os.setgid(65534); os.setuid(65534); "
            "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
            "try: s.sendall(b'{}\\n'); print(repr(s.recv(100)))\n"  # closed before or after the send
            "except (ConnectionResetError, BrokenPipeError): print('reset')"
        )
        other = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
        assert other.returncode == 0 and other.stdout.strip() in ("b''", "reset"), other  # closed, no answer
        deadline = time.monotonic() + TIMEOUT_S
        while "refused a connection from uid 65534 (1 so far)" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert "a launcher's hello failed" not in log.read_text()  # never read
    finally:
        proc.kill()
        proc.wait(timeout=30)
        shutil.rmtree(reachable, ignore_errors=True)
