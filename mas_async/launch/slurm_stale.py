"""Clearing what earlier runs of one SLURM job name left on this node: processes and shared memory.

The batch script of `mas-async slurm` runs `python -m mas_async.launch.slurm_stale --job-name J` once on
every node of the job (one task per node) before the launcher starts. Every process of a run carries
`MAS_ASYNC_JOB_NAME=J` in its environment (the script exports it and srun passes it to each step), and
SLURM gives it `SLURM_JOB_ID`. A process is stale when all of these hold:

- its environment says `MAS_ASYNC_JOB_NAME=J`: the same job name, never another one;
- its command line is a mas_async one (`python -m mas_async ...`);
- its `SLURM_JOB_ID` is not this job's, and SLURM no longer lists that job as pending, running or
  suspended (a live run of the same name is left alone).

Stale processes and every process they started get SIGTERM, then SIGKILL after `--grace-s`. Then the
/dev/shm files of this user that those processes had mapped or open, or that carry the job name
(`/dev/shm/J.<anything>`, the name a backend or env should give the shared memory of job J), are removed,
unless a live process still uses them. mas_async's own processes create no named shared memory today.
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

JOB_NAME_ENV = "MAS_ASYNC_JOB_NAME"
SHM_DIR = Path("/dev/shm")
ACTIVE_STATES = "PENDING,CONFIGURING,RUNNING,SUSPENDED,REQUEUED,RESIZING"
SQUEUE_TIMEOUT_S = 60.0


@dataclass
class Cleared:
    """What one clearing did on this node."""

    pids: list[int] = field(default_factory=list)
    shm: list[Path] = field(default_factory=list)


def active_slurm_jobs() -> set[str]:
    """Ids of the jobs SLURM lists as pending, running or suspended."""
    try:
        out = subprocess.run(
            ["squeue", "--noheader", f"--states={ACTIVE_STATES}", "--format=%A"],
            capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S, check=True,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"squeue did not answer in {SQUEUE_TIMEOUT_S:.0f} s; nothing was cleared") from None
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"squeue failed ({e.stderr.strip()}); nothing was cleared") from None
    return set(out.stdout.split())


def stale_processes(job_name: str, this_job: str | None, active: Callable[[], set[str]]) -> list[psutil.Process]:
    """The mas_async processes of earlier, ended jobs named `job_name`, and everything they started."""
    protected = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    candidates = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if env.get(JOB_NAME_ENV) != job_name or proc.pid in protected:
                continue
            job = env.get("SLURM_JOB_ID")
            if job and job != this_job and _is_mas_async(proc.cmdline()):
                candidates.append((proc, job))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    if not candidates:
        return []
    live_jobs = active()
    stale = {proc.pid: proc for proc, job in candidates if job not in live_jobs}
    for proc in list(stale.values()):
        try:
            stale.update({child.pid: child for child in proc.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
    return [proc for pid, proc in stale.items() if pid not in protected]


def _is_mas_async(cmdline: list[str]) -> bool:
    return any(arg == "mas_async" or arg.startswith("mas_async.") for arg in cmdline)


def shared_memory_of(procs: Iterable[psutil.Process]) -> set[Path]:
    """The /dev/shm files these processes have mapped or open."""
    found = set()
    for proc in procs:
        try:
            paths = [m.path for m in proc.memory_maps()] + [f.path for f in proc.open_files()]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        found.update(Path(p) for p in paths if p.startswith(f"{SHM_DIR}/"))
    return found


def shared_memory_named(job_name: str, shm_dir: Path) -> set[Path]:
    """This user's files in `shm_dir` that carry the job name: `J.<anything>`."""
    found = set()
    for path in shm_dir.glob(f"{glob.escape(job_name)}.*"):
        try:
            if path.is_file() and path.stat().st_uid == os.getuid():
                found.add(path)
        except FileNotFoundError:
            pass
    return found


def shared_memory_in_use() -> set[Path]:
    """The /dev/shm files any live process has mapped or open."""
    return shared_memory_of(psutil.process_iter())


def stop(procs: list[psutil.Process], grace_s: float) -> None:
    """SIGTERM, then SIGKILL for whatever still runs after `grace_s`."""
    for proc in procs:
        _send(proc, signal.SIGTERM)
    alive = _wait_gone(procs, grace_s)
    for proc in alive:
        _send(proc, signal.SIGKILL)
    alive = _wait_gone(alive, grace_s)
    if alive:
        raise RuntimeError(f"stale processes {[p.pid for p in alive]} survived SIGKILL for {grace_s:.0f} s")


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of `procs` still running after `timeout` s (a zombie has ended: only its parent can reap it)."""
    deadline = time.monotonic() + timeout
    while True:
        running = [p for p in procs if _running(p)]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.05)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _send(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def clear_stale(
    job_name: str,
    this_job: str | None,
    *,
    active: Callable[[], set[str]] = active_slurm_jobs,
    grace_s: float = 5.0,
    shm_dir: Path = SHM_DIR,
) -> Cleared:
    """Stop the stale processes of `job_name` on this node and remove the shared memory they left."""
    procs = stale_processes(job_name, this_job, active)
    shm = shared_memory_of(procs)
    stop(procs, grace_s)
    shm.update(shared_memory_named(job_name, shm_dir))
    in_use = shared_memory_in_use() if shm else set()
    removed = []
    for path in sorted(shm - in_use):
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return Cleared(pids=[p.pid for p in procs], shm=removed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mas_async.launch.slurm_stale", description=__doc__.splitlines()[0])
    parser.add_argument("--job-name", required=True, help="the SLURM job name whose earlier runs to clear")
    parser.add_argument("--grace-s", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL")
    args = parser.parse_args(argv)
    node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    cleared = clear_stale(args.job_name, os.environ.get("SLURM_JOB_ID"), grace_s=args.grace_s)
    print(
        f"mas-async slurm_stale on {node}: job name {args.job_name!r}: stopped {len(cleared.pids)} stale "
        f"processes {cleared.pids}, removed {len(cleared.shm)} /dev/shm files {[p.name for p in cleared.shm]}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
