"""The CPUs a process may really use (`mas_async/cpu_limit.py`), and the sandbox's concurrency sized by them:
a SLURM step of 1 CPU on a 128-core node must not run hundreds of tool programs at once on its one core
(each against a wall limit, so correct programs would time out as wrong). The affinity is faked, and the
cgroup files are laid out in a temporary folder as /proc/self/cgroup and /proc/self/mountinfo name them."""

from __future__ import annotations

from pathlib import Path

import pytest

from mas_async import cpu_limit
from mas_async.sandbox import capacity

GiB = 1 << 30


@pytest.fixture
def node_of_128(monkeypatch):
    """A 128-core machine whose affinity the test sets (all 128 unless it says)."""
    monkeypatch.setattr(cpu_limit.os, "cpu_count", lambda: 128)
    monkeypatch.setattr(cpu_limit.os, "sched_getaffinity", lambda pid: set(range(128)))
    return monkeypatch


def _proc(tmp_path: Path, cgroup: list[str], mounts: list[str]) -> tuple[str, str]:
    (tmp_path / "cgroup").write_text("\n".join(cgroup) + "\n")
    (tmp_path / "mountinfo").write_text("\n".join(mounts) + "\n")
    return str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_affinity_bounds_the_cpus(node_of_128, tmp_path) -> None:
    node_of_128.setattr(cpu_limit.os, "sched_getaffinity", lambda pid: {5, 6, 7})  # a step bound to 3 CPUs
    assert cpu_limit.usable_cpus(*_proc(tmp_path, [], [])) == 3


def test_a_cgroup_v2_quota_above_the_own_cgroup_bounds_the_cpus(node_of_128, tmp_path) -> None:
    mount = tmp_path / "unified"
    _write(mount / "system.slice/job_7/step_0/cpu.max", "max 100000\n")  # no limit of its own ...
    _write(mount / "system.slice/job_7/cpu.max", "250000 100000\n")  # ... its parent's: 2.5 CPUs
    proc = _proc(
        tmp_path,
        ["0::/system.slice/job_7/step_0"],
        [f"31 23 0:28 / {mount} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"],
    )
    assert cpu_limit.cgroup_cpu_quota(*proc) == 2.5
    assert cpu_limit.usable_cpus(*proc) == 2  # 2.5 CPUs cannot keep 3 busy
    node_of_128.setattr(cpu_limit.os, "sched_getaffinity", lambda pid: {0})
    assert cpu_limit.usable_cpus(*proc) == 1  # the smaller of the two


def test_a_cgroup_v1_quota_in_a_container_whose_mount_shows_its_own_root(node_of_128, tmp_path) -> None:
    """Docker's `--cpus=4` on a v1 machine: the cpu hierarchy mounted with the container's cgroup as its root,
    and a cgroup of 2 CPUs inside it that the process is in."""
    mount = tmp_path / "cpu,cpuacct"
    for folder, quota in ((mount, "400000"), (mount / "inner", "200000")):
        _write(folder / "cpu.cfs_quota_us", quota + "\n")
        _write(folder / "cpu.cfs_period_us", "100000\n")
    proc = _proc(
        tmp_path,
        ["5:memory:/docker/abc/inner", "4:cpu,cpuacct:/docker/abc/inner", "0::/"],
        [
            f"40 31 0:37 /docker/abc {mount} ro,nosuid - cgroup cgroup rw,cpu,cpuacct",
            f"41 31 0:38 /docker/abc {tmp_path}/memory ro,nosuid - cgroup cgroup rw,memory",
        ],
    )
    assert cpu_limit.usable_cpus(*proc) == 2
    _write(mount / "inner/cpu.cfs_quota_us", "-1\n")  # none of its own: the container's 4
    assert cpu_limit.usable_cpus(*proc) == 4
    _write(mount / "cpu.cfs_quota_us", "-1\n")  # no quota at all: the affinity's 128
    assert cpu_limit.usable_cpus(*proc) == 128


def test_the_sandbox_runs_four_programs_per_usable_cpu_not_per_core_of_the_machine(node_of_128) -> None:
    """A SLURM step of 1 CPU on a 128-core node: 4 runs at once, not 512."""
    node_of_128.setattr(cpu_limit, "cgroup_cpu_quota", lambda *paths: None)  # this machine's cgroups play no part
    node_of_128.setattr(cpu_limit.os, "sched_getaffinity", lambda pid: {17})
    node_of_128.setattr(capacity, "cgroup_root", lambda: "/sys/fs/cgroup/x")
    assert capacity.max_concurrency(1 * GiB) == 4
    node_of_128.setattr(cpu_limit.os, "sched_getaffinity", lambda pid: set(range(8)))
    node_of_128.setattr(capacity, "cgroup_root", lambda: None)
    node_of_128.setattr(capacity, "memory_available", lambda: 100 * GiB)
    assert capacity.max_concurrency(64 << 20) == 32  # 4 per usable CPU, memory to spare
