"""How many CPUs this process may really use: the one number that sizes concurrency by cores.

`os.cpu_count()` is the machine's cores, not this process's: a SLURM step of 1 CPU on a 128-core node,
a container given 2 CPUs, or a process pinned with `taskset` all see 128. `usable_cpus()` is the smallest of

- the CPUs this process may run on (`os.sched_getaffinity(0)`; a cpuset cgroup, SLURM's task/affinity
  and task/cgroup binding, taskset and numactl all show here), and
- the CPU bandwidth limit of its cgroup and of every cgroup above it: cgroup v2 `cpu.max`
  ("QUOTA PERIOD", or "max" for none), cgroup v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1 for none);
  a quota of 1.5 CPUs counts as 1 (it cannot keep 2 busy), never less than 1.

The cgroups are found as the kernel names them: this process's path per hierarchy in /proc/self/cgroup,
joined to where that hierarchy is mounted (/proc/self/mountinfo: its mount point and the root it shows).
"""

from __future__ import annotations

import os
from pathlib import Path

PROC_CGROUP = "/proc/self/cgroup"
PROC_MOUNTINFO = "/proc/self/mountinfo"


def usable_cpus(proc_cgroup: str = PROC_CGROUP, proc_mountinfo: str = PROC_MOUNTINFO) -> int:
    """The CPUs this process may use (module docstring): at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform (macOS)
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(proc_cgroup, proc_mountinfo)
    if quota is not None:
        cpus = min(cpus, max(1, int(quota)))
    return max(1, cpus)


def cgroup_cpu_quota(proc_cgroup: str = PROC_CGROUP, proc_mountinfo: str = PROC_MOUNTINFO) -> float | None:
    """The smallest CPU bandwidth limit (in CPUs) of this process's cgroups and their ancestors, v2 and v1;
    None when there is none or it cannot be read."""
    try:
        memberships = Path(proc_cgroup).read_text().splitlines()
        mounts = Path(proc_mountinfo).read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in memberships:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            directory = _cgroup_dir(path, mounts, lambda fstype, options: fstype == "cgroup2")
            limits += [_v2_limit(d) for d in _up_to_mount(directory)]
        elif "cpu" in controllers.split(","):
            directory = _cgroup_dir(path, mounts, lambda fstype, options: fstype == "cgroup" and "cpu" in options)
            limits += [_v1_limit(d) for d in _up_to_mount(directory)]
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def _cgroup_dir(path: str, mounts: list[str], wanted) -> tuple[Path, Path] | None:
    """(the cgroup's directory, its hierarchy's mount point) for cgroup `path` of the hierarchy whose mount
    `wanted(fstype, super_options)` picks; None when that hierarchy is not mounted here or the mount does not
    show the cgroup (a mount root outside it)."""
    for line in mounts:
        fields, sep, tail = line.partition(" - ")
        fields, tail = fields.split(), tail.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or not wanted(tail[0], tail[2].split(",")):
            continue
        root, mount_point = fields[3], Path(fields[4])
        relative = os.path.relpath(path, root) if root != "/" else path.lstrip("/")
        if relative.startswith(".."):
            continue
        return mount_point / relative, mount_point
    return None


def _up_to_mount(found: tuple[Path, Path] | None) -> list[Path]:
    """The cgroup's directory and every one above it up to its hierarchy's mount point."""
    if found is None:
        return []
    directory, mount_point = found
    chain = [directory]
    while chain[-1] != mount_point and mount_point in chain[-1].parents:
        chain.append(chain[-1].parent)
    return chain


def _v2_limit(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_limit(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None
