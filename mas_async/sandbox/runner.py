"""Run model-written Python in the sandbox: isolated by bubblewrap, limited, and nothing left behind.

Every piece of model-written code (the code env's programs and tests, the math and tool envs' tool
calls) runs through `await run_python(code, stdin=..., limits=Limits(...))`. It never blocks the
caller's event loop (asyncio subprocess, pipes read as they fill), many runs overlap (at most
`capacity.max_concurrency` per loop; a free slot goes to the episode furthest behind,
`mas_async.api.priority`), and it never raises for what the program does: an infinite loop, a crash
or a fork bomb is a `SandboxResult` with status "timeout", "error" or "killed". `run_python_sync` wraps
it for callers without a loop (tests, PettingZoo's synchronous `step`).

What isolates a run (docs/sandbox.md has the whole picture):

- bubblewrap (`bwrap.py`), root or not: no network, a read-only view of the interpreter and the
  packages a program may import and nothing else of the host (`view.py`), --die-with-parent,
  --new-session, a seccomp filter (`seccomp.py`);
- per run (`child.py`): its own mount, PID, network and IPC namespaces (and user namespace, or as root
  a uid of its own), a private /tmp, /dev/shm and work dir (size-capped tmpfs), rlimits (CPU time,
  address space, file size, processes, open files; hard limits too), no capabilities, no_new_privs,
  the program's seccomp filter (no exec, mounts or namespaces), a minimal environment;
- here: the wall clock (`limits.timeout_s`; then the run's process group is killed, and with its PID 1
  every process of the run), output capped per stream (a program printing 100 MB is killed having
  cost `limits.output_bytes`), a cgroup per run where a cgroup v2 subtree is delegated, else
  concurrency sized by memory (`capacity.py`).

Runs start from the zygote (`zygote.py`: a warm interpreter in one bubblewrap sandbox that forks each
run into its own namespaces; `bench/sandbox_start.py` measures what it saves) or, with `zygote=False`,
after three lost zygotes, for a request too large for its socket, or where runs get cgroups, from a
fresh `bwrap ... python child.py`. A zygote that dies loses no run: its runs start again afresh.

No silent fallback: where bubblewrap cannot isolate a run (`bwrap.unavailable()` says why),
`run_python` raises SandboxUnavailable with that sentence, unless the process was configured with
`sandbox.unsafe_no_isolation: true` (`configure`): runs are then plain subprocesses with rlimits only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import psutil

from mas_async.sandbox import bwrap, capacity
from mas_async.sandbox import zygote_client as zygote_client
from mas_async.sandbox.result import Limits, SandboxResult, SandboxUnavailable
from mas_async.sandbox.seccomp import bpf
from mas_async.sandbox.view import site_dirs

if TYPE_CHECKING:
    from mas_async.api.priority import PrioritySlots

log = logging.getLogger("mas_async.sandbox")
T = TypeVar("T")

STATUSES = ("ok", "error", "timeout", "killed")
CHILD = Path(__file__).with_name("child.py")
MAIN = "main.py"
MINIMAL_PATH = "/usr/local/bin:/usr/bin:/bin"
# One thread per math library: a thread counts against the process limit, and OpenBLAS would start
# one per core (dozens on a GPU machine) as soon as the program imports numpy.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
UNSAFE_HINT = (
    "; or, knowing that the model's programs then run unconfined, with this machine's files, keys and "
    "network within their reach, set sandbox.unsafe_no_isolation: true"
)

_unsafe_no_isolation = False
_uid_range_cache: tuple[int, int] | None = None
_uid_counter = itertools.count()
_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, PrioritySlots] = weakref.WeakKeyDictionary()


def configure(unsafe_no_isolation: bool = False, cgroup_root: str | None = None) -> None:
    """This process's sandbox settings, from the config's `sandbox` section (the env worker calls it)."""
    global _unsafe_no_isolation
    _unsafe_no_isolation = unsafe_no_isolation
    capacity.configure(cgroup_root)


def isolation_available() -> bool:
    """Whether bubblewrap isolates runs here (probed once per process)."""
    return bwrap.unavailable() is None


def require_isolation() -> None:
    """Raise SandboxUnavailable, with what to install, where runs could not be isolated and the process
    was not configured to run them unconfined."""
    reason = bwrap.unavailable()
    if reason is not None and not _unsafe_no_isolation:
        raise SandboxUnavailable(f"sandbox: {reason}{UNSAFE_HINT}")


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


def _run_slots(memory_bytes: int) -> PrioritySlots:
    """The loop's slots; the episode furthest behind gets a free one first."""
    from mas_async.api.priority import PrioritySlots

    loop = asyncio.get_running_loop()
    if loop not in _slots:
        _slots[loop] = PrioritySlots(capacity.max_concurrency(memory_bytes))
    return _slots[loop]


async def run_python(
    code: str,
    *,
    stdin: str | bytes | None = None,
    files: dict[str, str] | None = None,
    limits: Limits | None = None,
    zygote: bool = True,
) -> SandboxResult:
    """Run `code` as `__main__` in a fresh sandbox; `files` are extra files in its work dir.
    zygote: start the run by a fork of the warm zygote (False: a fresh interpreter)."""
    require_isolation()
    limits = limits or Limits()
    files = {**(files or {}), MAIN: code}
    for name in files:
        if "/" in name or name.startswith(".") or not name:
            raise ValueError(f"sandbox: file name {name!r} must be a plain name inside the work dir")
    data = stdin.encode() if isinstance(stdin, str) else stdin
    async with _run_slots(limits.memory_bytes):
        if not isolation_available():
            return await _run_unconfined(files, data, limits)
        return await _run_isolated(files, data, limits, zygote)


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


def request(files: dict[str, str], limits: Limits, workdir: str, isolated: bool) -> dict[str, Any]:
    """What `child.lead` needs to run the program of `files` (`MAIN` is the program)."""
    uid = _next_uid() if isolated and bwrap.is_root() else None
    return {
        "isolated": isolated,
        "files": files,
        "main": MAIN,
        "workdir": workdir,
        "limits": asdict(limits),
        "uid": uid,
        "seccomp": bpf(program=True).hex() if isolated else "",
        "site_dirs": list(site_dirs()),
        "env": environment(workdir),
    }


def environment(home: str) -> dict[str, str]:
    """A run's whole environment; `home` is its work dir (HOME and TMPDIR)."""
    env = {"PATH": MINIMAL_PATH, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": home, "TMPDIR": home}
    return env | {name: "1" for name in THREAD_VARIABLES}


async def _run_isolated(files: dict[str, str], data: bytes | None, limits: Limits, zygote: bool) -> SandboxResult:
    run = request(files, limits, bwrap.WORKDIR, isolated=True)
    root = capacity.cgroup_root()
    # A cgroup is joined before bubblewrap starts, which a fork of the zygote cannot do: such runs start afresh.
    warm = zygote_client.zygote(environment("/")) if zygote and root is None else None
    if warm is not None:
        start = time.monotonic()
        try:
            process = await warm.spawn(run, stdin=data is not None)
        except zygote_client.ZygoteLost:
            pass  # started afresh below
        else:
            try:
                return await _supervise(process, start, data, limits, isolated=True)
            except zygote_client.ZygoteLost:
                pass  # the zygote died during the run, and the run with it: run it again below
            finally:
                process.close()
    cgroup = capacity.RunCgroup(root, limits.memory_bytes, limits.processes) if root is not None else None
    request_fd = os.memfd_create("sandbox-request")
    seccomp_read, seccomp_write = os.pipe()
    try:
        os.write(request_fd, json.dumps(run).encode())
        os.lseek(request_fd, 0, os.SEEK_SET)
        os.write(seccomp_write, bpf(program=False))
        os.close(seccomp_write)
        seccomp_write = -1
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *bwrap.command("child.py", [str(request_fd)], seccomp_read),
            stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={},
            cwd="/",
            start_new_session=True,
            pass_fds=[request_fd, seccomp_read],
            preexec_fn=cgroup.join if cgroup is not None else None,
        )
    finally:
        for fd in (request_fd, seccomp_read, seccomp_write):
            if fd >= 0:
                os.close(fd)
    try:
        return await _supervise(proc, start, data, limits, isolated=True)
    finally:
        if cgroup is not None:
            cgroup.remove()


async def _run_unconfined(files: dict[str, str], data: bytes | None, limits: Limits) -> SandboxResult:
    """`sandbox.unsafe_no_isolation`: a plain subprocess in a temp dir, with the rlimits only."""
    workdir = tempfile.mkdtemp(prefix="mas-sandbox-")
    request_fd = os.memfd_create("sandbox-request")
    try:
        for name, text in files.items():
            Path(workdir, name).write_text(text)
        os.write(request_fd, json.dumps(request(files, limits, workdir, isolated=False)).encode())
        os.lseek(request_fd, 0, os.SEEK_SET)
        start = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", str(CHILD), str(request_fd),
                stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=environment(workdir),
                cwd=workdir,
                start_new_session=True,
                pass_fds=[request_fd],
            )  # fmt: skip
        finally:
            os.close(request_fd)
        return await _supervise(proc, start, data, limits, isolated=False, workdir=workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def _supervise(
    proc, start: float, data: bytes | None, limits: Limits, isolated: bool, workdir: str = ""
) -> SandboxResult:
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
        _kill(proc)  # always: leftovers of a program that exited, or one still running
        overflowed.cancel()
        # A process that left the group (unconfined only: setsid) may hold the pipes open, and
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


def _kill(proc: asyncio.subprocess.Process | zygote_client.ZygoteRun) -> None:
    """SIGKILL to a run's process group: the zygote's run through the zygote; a fresh run's group is
    bubblewrap's (or the unconfined program's), and bubblewrap's death ends the sandbox (its PID 1
    dies with it, and every process of its PID namespace with that)."""
    if isinstance(proc, zygote_client.ZygoteRun):
        proc.kill()
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


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
    """Unconfined runs: kill processes of this run that left its process group (found by their work dir)."""
    for proc in psutil.process_iter(["cwd"]):
        cwd = proc.info["cwd"] or ""
        if cwd == workdir or cwd.startswith(workdir + "/"):
            with contextlib.suppress(psutil.Error):
                proc.kill()
