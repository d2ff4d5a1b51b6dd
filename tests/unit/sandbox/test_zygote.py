"""The sandbox's zygote: isolated runs are forked from it, a program ends exactly as in a fresh
interpreter, and a zygote that dies or cannot start loses no run. (Every attack of test_sandbox.py
runs through the zygote too: isolated runs start from it by default.)"""

from __future__ import annotations

import ast
import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mas_async import sandbox
from mas_async.sandbox import Limits, SandboxResult, bwrap, run_python, run_python_sync
from mas_async.sandbox import zygote_client as zygote_client
from mas_async.sandbox.runner import environment, request

pytestmark = [pytest.mark.timing, pytest.mark.skipif(bwrap.unavailable() is not None, reason=str(bwrap.unavailable()))]


def _wait_until(check, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def _run_processes(zygote: zygote_client.Zygote) -> list[psutil.Process]:
    """The processes of the zygote's runs: below the zygote's interpreter (itself below bubblewrap)."""
    try:
        inside = psutil.Process(zygote.pid).children(recursive=True)
        ours = {p.pid for p in inside if "/.sandbox/zygote.py" in p.cmdline()[:4]}  # not bubblewrap's own
        top = [p for p in inside if p.pid in ours and p.ppid() not in ours]  # the zygote, not its forks
        return top[0].children(recursive=True) if top else []
    except psutil.Error:
        return []


@pytest.fixture
def zygote_script(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Replace the zygote's script (bubblewrap binds the scripts of `bwrap.SCRIPTS`) for one test."""

    def use(source: str) -> None:
        scripts = tmp_path / "scripts"
        scripts.mkdir()
        (scripts / "child.py").write_text((bwrap.SCRIPTS / "child.py").read_text())
        (scripts / "zygote.py").write_text(source)
        scripts.chmod(0o755)
        monkeypatch.setattr(bwrap, "SCRIPTS", scripts)
        bwrap._prefix.cache_clear()

    yield use
    bwrap._prefix.cache_clear()


@pytest.fixture
def fresh_zygotes(monkeypatch: pytest.MonkeyPatch):
    """This test's own zygotes and loss count (the process's shared one is put back afterwards)."""
    monkeypatch.setattr(zygote_client, "_shared", None)
    monkeypatch.setattr(zygote_client, "_losses", 0)
    yield
    if zygote_client._shared is not None:
        zygote_client._shared.close()


def test_isolated_runs_are_forked_by_the_zygote(fresh_zygotes: None) -> None:
    async def main() -> tuple[SandboxResult, list[tuple[list[str], list[str]]], bool]:
        task = asyncio.create_task(run_python("import time\ntime.sleep(1.0)\nprint('done')"))
        await asyncio.sleep(0.5)
        zygote = zygote_client._shared
        assert zygote is not None
        runs = [(p.cmdline(), _pids_by_namespace(p.pid)) for p in _run_processes(zygote)]
        fresh = any("/.sandbox/child.py" in p.cmdline()[:4] for p in psutil.Process().children(recursive=True))
        return await task, runs, fresh

    result, runs, fresh = asyncio.run(main())
    assert result.ok and result.isolated and result.stdout == "done\n"
    # the namespace's init, forked by the zygote straight into the run's namespaces, and the program:
    # forks of the zygote, no leader in between and no fresh interpreter
    assert len(runs) == 2 and all("/.sandbox/zygote.py" in " ".join(cmd) for cmd, _ in runs)
    assert [pids[-1] for _, pids in runs] == ["1", "2"]  # their pids in the run's own PID namespace
    assert not fresh


def _pids_by_namespace(pid: int) -> list[str]:
    """A process's pid in each PID namespace it is in, outermost first (NSpid in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        return next(line.split()[1:] for line in f if line.startswith("NSpid:"))


ENDINGS = {
    "unflushed output": ("print('no newline', end='')", None),
    "exit status": ("import sys\nprint('a')\nsys.exit(3)", None),
    "exit message": ("import sys\nsys.exit('bye')", None),
    "exception": ("print('before')\nraise ValueError('boom')", None),
    "os._exit": ("import os\nos._exit(7)", None),
    "signal": ("import os, signal\nprint('x', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)", None),
    "atexit": ("import atexit\natexit.register(print, 'at exit')\nprint('main')", None),
    "thread": (
        "import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.3), print('late'))).start()",
        None,
    ),
    "excepthook": ("import sys\nsys.excepthook = lambda *a: print('hooked')\nraise RuntimeError", None),
    "stdin": ("print(input()[::-1])", "olleh\n"),
    "fds and pid": ("import os\nprint(sorted(os.listdir('/proc/self/fd')), os.getpid(), os.getppid())", None),
    "processes seen": ("import os\nprint(sorted(p for p in os.listdir('/proc') if p.isdigit()))", None),
    "where": (
        "import os, sys\nprint(os.getcwd() == os.environ['HOME'], sys.argv[0].endswith('main.py'), os.getuid() > 0)",
        None,
    ),
}


@pytest.mark.parametrize("name", ENDINGS)
def test_a_program_ends_as_in_a_fresh_interpreter(name: str) -> None:
    code, stdin = ENDINGS[name]
    warm, fresh = (run_python_sync(code, stdin=stdin, zygote=zygote) for zygote in (True, False))
    assert (warm.status, warm.returncode, warm.detail, warm.stdout) == (
        fresh.status,
        fresh.returncode,
        fresh.detail,
        fresh.stdout,
    )
    last = [r.stderr.strip().splitlines()[-1:] for r in (warm, fresh)]
    assert last[0] == last[1]


def test_the_program_sees_only_its_own_fds_and_runs_get_their_own_random_state() -> None:
    code = "import os, random\nprint(sorted(os.listdir('/proc/self/fd')), random.random(), os.getpid())"
    outputs = [run_python_sync(code).stdout.split() for _ in range(3)]
    assert all(out[:4] == ["['0',", "'1',", "'2',", "'3']"] for out in outputs)  # 3: the listing's own
    assert len({out[4] for out in outputs}) == 3


def test_the_function_test_harness_finds_its_modules_imported() -> None:
    # Most runs are the harness's (sandbox/harness.py); a module it imports that the zygote has not costs
    # every run its import (`random`: ~1.5 ms of ~14).
    harness = ast.parse((Path(sandbox.__file__).parent / "harness.py").read_text())
    imported = sorted({alias.name for node in harness.body if isinstance(node, ast.Import) for alias in node.names})
    assert "random" in imported
    code = f"import sys\nprint(sorted(set({imported!r}) - set(sys.modules)))"
    warm = run_python_sync(code)
    assert warm.ok and warm.stdout == "[]\n", warm


def test_a_run_finds_what_runpy_imports_already_imported(tmp_path: Path) -> None:
    # runpy.run_path imports pkgutil (and weakref) at each call: a zygote without them makes every run
    # import them (~1.3 ms). The zygote's imports, then a program run as each run's is: nothing new.
    program = tmp_path / "main.py"
    program.write_text("x = sum(range(1000))\n")
    zygote_py = Path(sandbox.__file__).parent / "zygote.py"
    probe = (
        "import importlib.util, runpy, site, sys\n"
        f"spec = importlib.util.spec_from_file_location('zygote', {str(zygote_py)!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "before = set(sys.modules)\n"
        f"runpy.run_path({str(program)!r}, run_name='__main__')\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    out = subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "[]\n", out


def test_a_lost_zygote_loses_no_run(fresh_zygotes: None) -> None:
    async def main() -> tuple[SandboxResult, list[psutil.Process]]:
        task = asyncio.create_task(run_python("import time\ntime.sleep(1.0)\nprint('done')"))
        assert await asyncio.to_thread(
            _wait_until, lambda: zygote_client._shared and _run_processes(zygote_client._shared)
        )
        zygote = zygote_client._shared
        runs = _run_processes(zygote)
        os.kill(zygote.pid, signal.SIGKILL)
        return await task, runs

    first = zygote_client._shared
    result, runs = asyncio.run(main())
    assert result.ok and result.stdout == "done\n"  # run again, on a fresh interpreter
    assert _wait_until(lambda: not any(_alive(p) for p in runs), 5.0)
    lost = zygote_client._shared
    assert lost is not first and lost.lost
    again = run_python_sync("print(2)")
    assert again.ok and zygote_client._shared is not lost and zygote_client._losses == 1


def _sleeper() -> dict:
    files = {"main.py": "import time\ntime.sleep(60)"}
    return request(files, Limits(timeout_s=120, cpu_s=120), bwrap.WORKDIR, isolated=True)


def test_a_runs_processes_die_with_its_zygote() -> None:
    """Without the sandbox's kill of the run's group: the namespace's init dies with its parent, the
    zygote (PDEATHSIG), and the kernel ends the program with its namespace."""
    zygote = zygote_client.Zygote(environment("/"))

    async def main() -> list[psutil.Process]:
        run = await zygote.spawn(_sleeper(), stdin=False)
        try:
            assert await asyncio.to_thread(_wait_until, lambda: len(_run_processes(zygote)) == 2)
            runs = _run_processes(zygote)
            os.kill(zygote.pid, signal.SIGKILL)
            with pytest.raises(zygote_client.ZygoteLost):
                await run.wait()
            return runs
        finally:
            run.close()

    try:
        runs = asyncio.run(main())
    finally:
        zygote.close()
    assert len(runs) == 2
    assert _wait_until(lambda: not any(_alive(p) for p in runs), 5.0)


def test_a_run_cancelled_while_it_starts_is_ended() -> None:
    """A caller cancelled before the zygote answered supervises nothing: the run is killed once it exists."""
    zygote = zygote_client.Zygote(environment("/"))

    async def main() -> None:
        task = asyncio.create_task(zygote.spawn(_sleeper(), stdin=False))
        await asyncio.sleep(0)  # the request is sent; the answer is not in yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(1.0)  # the answer arrives, and the run is killed

    try:
        asyncio.run(main())
        assert _wait_until(lambda: not _run_processes(zygote), 5.0)
    finally:
        zygote.close()


def _alive(process: psutil.Process | int) -> bool:
    try:
        process = psutil.Process(process) if isinstance(process, int) else process
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_zygote_that_cannot_start_runs_falls_back_after_three_losses(
    fresh_zygotes: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(zygote_client, "ZYGOTE", "nonexistent.py")  # its interpreter exits at once
    with caplog.at_level(logging.WARNING, logger="mas_async.sandbox"):
        results = [run_python_sync(f"print({i})") for i in range(5)]
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(5)] and all(r.isolated for r in results)
    assert zygote_client._losses == zygote_client.MAX_LOSSES and zygote_client._shared is None
    assert "zygotes lost; runs start on fresh interpreters" in caplog.text


def test_a_zygote_that_does_not_answer_is_ended_and_its_run_started_afresh(
    fresh_zygotes: None, monkeypatch: pytest.MonkeyPatch, zygote_script
) -> None:
    zygote_script("import time\ntime.sleep(60)\n")  # takes the socket, never answers
    monkeypatch.setattr(zygote_client, "START_TIMEOUT_S", 0.5)
    start = time.monotonic()
    result = run_python_sync("print('afresh')")
    assert result.ok and result.stdout == "afresh\n" and time.monotonic() - start < 10.0
    lost = zygote_client._shared
    assert "did not start a run within 0.5s" in lost.lost
    assert _wait_until(lambda: lost.process.poll() is not None, 5.0)  # ended, not left behind


GARBAGE_ZYGOTE = """
import json, socket, sys, time
sock = socket.socket(fileno=int(sys.argv[1]))
message, fds, _flags, _address = socket.recv_fds(sock, 1 << 20, 3)
sock.send(json.dumps({"id": json.loads(message)["id"], "pid": 999999}).encode())
time.sleep(0.3)
sock.send(b"\\xff not an answer")  # instead of the run's return code
time.sleep(60)
"""


def test_a_zygote_that_answers_garbage_is_lost_and_its_run_started_afresh(fresh_zygotes: None, zygote_script) -> None:
    """The reader thread's end, whatever ends it, loses the zygote: the run's wait for its return code
    ends (ZygoteLost) and the run starts afresh, instead of waiting for an answer nobody reads."""
    zygote_script(GARBAGE_ZYGOTE)

    async def main() -> SandboxResult:
        return await asyncio.wait_for(run_python("print('afresh')", limits=Limits(timeout_s=60.0)), 30.0)

    start = time.monotonic()
    result = asyncio.run(main())
    assert result.ok and result.stdout == "afresh\n" and time.monotonic() - start < 15.0
    lost = zygote_client._shared
    assert lost.lost is not None and "could not be read" in lost.lost
    assert _wait_until(lambda: lost.process.poll() is not None, 5.0)


def test_the_zygote_ends_with_its_parent() -> None:
    script = "from mas_async.sandbox import run_python_sync\nimport mas_async.sandbox.zygote_client as z, os\n"
    script += "assert run_python_sync('print(1)').ok\nprint(z._shared.pid, flush=True)\nos._exit(0)\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    pid = int(out.stdout)

    assert _wait_until(lambda: not _alive(pid), 10.0)
