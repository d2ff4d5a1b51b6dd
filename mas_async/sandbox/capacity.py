"""How much the sandbox's runs may hold together: a cgroup per run where a cgroup v2 subtree is
delegated to this process, else a number of concurrent runs sized by the memory available.

- `cgroup_root()`: a cgroup v2 directory where this process may make a child cgroup per run with the
  memory and pids controllers: `sandbox.cgroup_root` from the config (`configure`), else this
  process's own cgroup when its `cgroup.subtree_control` already enables memory and pids and it is
  writable (a delegated subtree, e.g. systemd's `Delegate=yes`). None otherwise (a cgroup v1 or
  hybrid machine, or nothing delegated).
- `RunCgroup`: one run's cgroup (memory.max and memory.swap.max: the run's memory, all its processes
  together; pids.max: its processes and threads); the run's first process moves itself in before it
  execs bubblewrap, so everything the run starts is inside; removed when the run has ended.
- `max_concurrency(memory_bytes)`: runs in flight per event loop: 4 per CPU this process may use
  (`mas_async.cpu_limit.usable_cpus`: its affinity and its cgroup's CPU quota, not the machine's cores:
  under a SLURM step of 1 CPU on a 128-core node, 4 runs share that CPU, not 512), and without a cgroup
  also at most half of the memory available now divided by a run's memory limit, so that a batch of
  hostile programs, each at its limit, cannot take a node's memory from its trainer.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from pathlib import Path

from mas_async.cpu_limit import usable_cpus

CONTROLLERS = ("memory", "pids")
_configured_root: str | None = None
_names = itertools.count()


def configure(root: str | None) -> None:
    """Use `root` (a delegated cgroup v2 directory) for the runs' cgroups; None: find one."""
    global _configured_root
    _configured_root = root
    cgroup_root.cache_clear()


@functools.cache
def cgroup_root() -> str | None:
    if _configured_root is not None:
        if not _usable(_configured_root):
            raise ValueError(
                f"sandbox.cgroup_root={_configured_root}: not a writable cgroup v2 directory whose "
                f"cgroup.subtree_control enables {' and '.join(CONTROLLERS)}"
            )
        return _configured_root
    own = _own_cgroup()
    return own if own is not None and _usable(own) else None


def _own_cgroup() -> str | None:
    """This process's cgroup v2 directory (the unified hierarchy's mount point plus its path)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    path = next((line[3:] for line in lines if line.startswith("0::")), None)
    mount = next((line.split()[4] for line in mounts if " - cgroup2 " in line), None)
    if path is None or mount is None:
        return None
    return os.path.join(mount, path.lstrip("/"))


def _usable(directory: str) -> bool:
    try:
        enabled = Path(directory, "cgroup.subtree_control").read_text().split()
    except OSError:
        return False
    return all(c in enabled for c in CONTROLLERS) and os.access(directory, os.W_OK | os.X_OK)


class RunCgroup:
    """One run's cgroup under `root`: made with its limits, joined by the run, removed after it."""

    def __init__(self, root: str, memory_bytes: int, processes: int) -> None:
        self.path = os.path.join(root, f"mas-sandbox-{os.getpid()}-{next(_names)}")
        os.mkdir(self.path)
        self._write("memory.max", str(memory_bytes))
        self._write("pids.max", str(processes + 2))  # and the run's leader and PID 1
        with contextlib.suppress(OSError):  # no swap accounting on this kernel: nothing to cap
            self._write("memory.swap.max", "0")

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def join(self) -> None:
        """Move the calling process in (a child's preexec, before it execs bubblewrap)."""
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write("0")

    def remove(self) -> None:
        """Remove the cgroup (its processes are gone: the run's process group was killed)."""
        with contextlib.suppress(OSError):
            os.rmdir(self.path)


def memory_available() -> int:
    """MemAvailable of /proc/meminfo, in bytes (0 when unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def max_concurrency(memory_bytes: int) -> int:
    """Runs in flight per event loop (see the module's docstring)."""
    by_cores = 4 * usable_cpus()
    if cgroup_root() is not None:
        return by_cores
    available = memory_available()
    if available <= 0:
        return by_cores
    return max(1, min(by_cores, available // 2 // memory_bytes))
