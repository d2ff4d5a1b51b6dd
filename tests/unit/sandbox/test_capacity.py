"""How much the sandbox's runs may hold together (`mas_async/sandbox/capacity.py`): without a cgroup, the
number of concurrent runs is sized by the memory available; with a delegated cgroup v2 subtree, each run
gets a cgroup with its limits, joined before bubblewrap starts.

The wiring is tested everywhere with a stand-in directory laid out as a delegated cgroup (its files are
plain files, so nothing is enforced); the kernel's enforcement only where a real cgroup v2 subtree with
the memory and pids controllers is delegated to this process (not on cgroup v1 machines, such as CI's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mas_async.sandbox import Limits, bwrap, capacity, run_python_sync

GiB = 1 << 30


@pytest.fixture
def stand_in(tmp_path: Path):
    """A directory laid out as a delegated cgroup v2 subtree, configured as the runs' cgroup root."""
    (tmp_path / "cgroup.subtree_control").write_text("cpu memory pids\n")
    capacity.configure(str(tmp_path))
    yield tmp_path
    capacity.configure(None)


def test_without_a_cgroup_concurrency_is_sized_by_the_memory_available(monkeypatch) -> None:
    monkeypatch.setattr(capacity, "cgroup_root", lambda: None)
    monkeypatch.setattr(capacity, "usable_cpus", lambda: 8)
    monkeypatch.setattr(capacity, "memory_available", lambda: 10 * GiB)
    assert capacity.max_concurrency(1 * GiB) == 5  # half the memory available, a run's limit each
    assert capacity.max_concurrency(64 << 20) == 32  # 4 per core at most
    monkeypatch.setattr(capacity, "memory_available", lambda: 1 * GiB)
    assert capacity.max_concurrency(1 * GiB) == 1  # never zero: the runs go one at a time
    monkeypatch.setattr(capacity, "cgroup_root", lambda: "/sys/fs/cgroup/x")
    assert capacity.max_concurrency(1 * GiB) == 32  # each run's cgroup holds it to its limit


def test_a_configured_root_that_is_not_a_delegated_cgroup_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cgroup.subtree_control").write_text("cpu memory\n")  # no pids controller
    capacity.configure(str(tmp_path))
    try:
        with pytest.raises(ValueError, match="sandbox.cgroup_root=.*enables memory and pids"):
            capacity.cgroup_root()
    finally:
        capacity.configure(None)


def test_a_run_cgroup_gets_the_runs_limits(stand_in: Path) -> None:
    group = capacity.RunCgroup(str(stand_in), memory_bytes=256 << 20, processes=16)
    path = Path(group.path)
    assert path.parent == stand_in
    assert (path / "memory.max").read_text() == str(256 << 20)
    assert (path / "pids.max").read_text() == "18"  # the run's processes, its leader and its PID 1
    assert (path / "memory.swap.max").read_text() == "0"
    group.join()
    assert (path / "cgroup.procs").read_text() == "0"  # "0": the writing process moves itself in


@pytest.mark.skipif(bwrap.unavailable() is not None, reason=str(bwrap.unavailable()))
def test_a_run_with_a_cgroup_root_starts_afresh_in_its_own_cgroup(stand_in: Path) -> None:
    result = run_python_sync("print('in')", limits=Limits(memory_bytes=300 << 20, processes=8))
    assert result.status == "ok" and result.stdout == "in\n" and result.isolated
    made = [p for p in stand_in.iterdir() if p.name.startswith("mas-sandbox-")]
    assert len(made) == 1, made  # the run's own cgroup (a stand-in keeps its files, so it stays)
    assert (made[0] / "memory.max").read_text() == str(300 << 20)
    assert (made[0] / "cgroup.procs").read_text() == "0"  # its first process joined before bubblewrap


def _delegated() -> str | None:
    capacity.configure(None)
    return capacity.cgroup_root()


@pytest.mark.skipif(_delegated() is None, reason="no cgroup v2 subtree with memory and pids is delegated here")
def test_a_delegated_cgroup_holds_a_run_to_its_memory_in_all() -> None:
    """Four processes of 200 MiB each: every one is within its own address-space rlimit (512 MiB), together
    they are over the run's cgroup (512 MiB): the kernel kills one."""
    code = """
import os, time
children = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = bytearray(200 << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        time.sleep(2)
        os._exit(0)
    children.append(pid)
print([os.waitpid(pid, 0)[1] for pid in children])
"""
    result = run_python_sync(code, limits=Limits(memory_bytes=512 << 20, timeout_s=30))
    assert result.status != "ok" or result.stdout.strip() != "[0, 0, 0, 0]", result
