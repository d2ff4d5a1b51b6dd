"""A real 2-node SLURM cluster on this machine, for the `slurm` tests: munged, slurmctld and two slurmd.

Debian's slurm-wlm is built with MULTIPLE_SLURMD: two NodeName lines on 127.0.0.1 with different ports,
and `slurmd -N node1`, `slurmd -N node2`, give two nodes that jobs and steps really run on. Each declares
16 CPUs (more than this machine has) and 4 GPUs as GRES on character devices the cluster creates, which
slurmd hands to steps as their CUDA_VISIBLE_DEVICES (there is no GPU behind them). Every file
(slurm.conf, cgroup.conf, munge key and socket, state, logs, pid files) lives in one temporary folder;
no systemd, nothing in /etc. Only cores are scheduled (`CR_Core`), or in the `memory` variant memory too
(`SelectTypeParameters=CR_Core_Memory` and `DefMemPerGPU`), as on most GPU clusters. The daemons run in the
foreground as children of the test, munged as the munge user, and are stopped by pid. Processes are tracked with proctrack/cgroup (cgroup v1 freezer):
the end of a step kills everything it started, double-forked processes too. Where the v1 freezer
hierarchy is not mounted, proctrack/linuxproc is used instead, which loses double-forked processes.

    with running_slurm_cluster() as cluster:
        subprocess.run(["sbatch", ...], env=cluster.env)
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from mas_async.deployment import free_ports

NODES = ("node1", "node2")
GPUS_PER_NODE = 4
"""GPUs each node declares as GRES, on device files the cluster creates (no GPU behind them)."""
LOCAL_MAJOR = 240
CPUS_PER_NODE = 16
"""CPUs each node declares (more than this machine has: `SlurmdParameters=config_overrides`); the steps
of a run need one or more each, and the processes share the real cores."""
MEMORY_PER_NODE_MB = 16000
"""Memory each node declares (RealMemory; scheduled only in the `memory` variant, never enforced)."""
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel")
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 20.0
FREEZER = Path("/sys/fs/cgroup/freezer")


def skip_reason() -> str | None:
    """Why the SLURM tests cannot run here, or None."""
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"SLURM/munge not installed ({', '.join(missing)} missing): run .ci/install_slurm.sh as root"
    if os.geteuid() != 0:
        return "the test SLURM cluster runs its daemons as root (and munged as the munge user)"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no munge user (the munge package creates it)"
    return None


@dataclass
class SlurmCluster:
    dir: Path
    env: dict[str, str]
    """os.environ plus SLURM_CONF: the environment for sbatch, squeue, ..."""
    proctrack: str
    memory: bool = False
    """Memory is a consumable resource (`CR_Core_Memory`), as on most GPU clusters: a step that asks for
    memory (`--mem=N`) holds it, and the other steps of its job cannot get it."""
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)

    def command(self, *args: str, timeout: float = 30.0) -> str:
        out = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"`{' '.join(args)}` failed: {out.stderr.strip()}")
        return out.stdout

    def logs(self) -> str:
        """The tail of every daemon's log, for failure messages."""
        parts = []
        for path in sorted((self.dir / "log").iterdir()):
            lines = path.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"== {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)


def write_config(root: Path, proctrack: str, memory: bool = False) -> None:
    ctld_port, *node_ports = free_ports("127.0.0.1", 1 + len(NODES))
    host = socket.gethostname().split(".")[0]
    node_lines = [
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={CPUS_PER_NODE} "
        f"Gres=gpu:{GPUS_PER_NODE} RealMemory={MEMORY_PER_NODE_MB} State=UNKNOWN"
        for name, port in zip(NODES, node_ports, strict=True)
    ]
    (root / "slurm.conf").write_text(
        "\n".join(
            [
                "ClusterName=masasync",
                f"SlurmctldHost={host}(127.0.0.1)",
                f"SlurmctldPort={ctld_port}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                # A requeued job may start again cred_expire seconds later (120 by default), and the
                # scheduler looks at the queue every sched_interval seconds (60): both short here.
                f"AuthInfo=socket={root}/munge/munge.socket,cred_expire=10",
                "SchedulerType=sched/builtin",
                "SchedulerParameters=sched_interval=1",
                f"StateSaveLocation={root}/state",
                f"SlurmdSpoolDir={root}/spool/%n",
                f"SlurmctldPidFile={root}/slurmctld.pid",
                f"SlurmdPidFile={root}/slurmd.%n.pid",
                f"SlurmctldLogFile={root}/log/slurmctld.log",
                f"SlurmdLogFile={root}/log/slurmd.%n.log",
                f"ProctrackType=proctrack/{proctrack}",
                "TaskPlugin=task/none",
                "GresTypes=gpu",
                "SlurmdParameters=config_overrides",
                "MpiDefault=none",
                "SelectType=select/cons_tres",
                f"SelectTypeParameters={'CR_Core_Memory' if memory else 'CR_Core'}",
                # As GPU clusters that schedule memory often do: a GPU brings its share of the node's memory.
                *([f"DefMemPerGPU={MEMORY_PER_NODE_MB // GPUS_PER_NODE}"] if memory else []),
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "ReturnToService=2",
                "KillWait=5",
                "MinJobAge=600",
                *node_lines,
                f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    # GPUs as GRES on character devices of a major number reserved for local use (240, devices.txt): no
    # driver is behind them (opening one fails), slurmd only reads their numbers and hands them to steps
    # (CUDA_VISIBLE_DEVICES); cgroup device constraints are off (ConstrainDevices=no), so nothing is hidden.
    gres = []
    (root / "dev").mkdir()
    for n, name in enumerate(NODES):
        for i in range(GPUS_PER_NODE):
            path = root / "dev" / f"{name}-gpu{i}"
            os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(LOCAL_MAJOR, n * GPUS_PER_NODE + i))
            gres.append(f"NodeName={name} Name=gpu File={path}")
    (root / "gres.conf").write_text("\n".join(["AutoDetect=off", *gres, ""]))
    # Read from beside slurm.conf; only tracking, no confinement (the processes share this machine's cores).
    (root / "cgroup.conf").write_text(
        "CgroupPlugin=cgroup/v1\nConstrainCores=no\nConstrainRAMSpace=no\nConstrainDevices=no\n"
    )


def start_munged(root: Path) -> subprocess.Popen:
    munge = pwd.getpwnam("munge")
    folder = root / "munge"  # the socket's folder must be readable by all, the key private to munge
    folder.mkdir(mode=0o755)
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    for path in (folder, key):
        os.chown(path, munge.pw_uid, munge.pw_gid)
    args = [f"--socket={folder}/munge.socket", f"--key-file={key}", f"--log-file={root}/log/munged.log"]
    args += [f"--pid-file={folder}/munged.pid", f"--seed-file={folder}/munged.seed", "--foreground"]
    with (root / "log" / "munged.stderr").open("wb") as stderr:  # in the foreground it logs here
        return subprocess.Popen(
            ["munged", *args], user=munge.pw_uid, group=munge.pw_gid, extra_groups=[],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip


def wait_until(what: str, check, timeout: float, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"test SLURM cluster: {what} not within {timeout:.0f} s\n{cluster.logs()}")
        for name, proc in cluster.daemons.items():
            if proc.poll() is not None:
                raise RuntimeError(f"test SLURM cluster: {name} exited ({proc.returncode})\n{cluster.logs()}")
        time.sleep(0.2)


def start(cluster: SlurmCluster) -> None:
    """Write the config and start the daemons into `cluster` (so that `stop` finds them if this fails)."""
    root = cluster.dir
    for folder in ("state", "spool", "log"):
        (root / folder).mkdir()
    write_config(root, cluster.proctrack, cluster.memory)
    conf = ["-f", str(root / "slurm.conf")]
    quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    cluster.daemons["munged"] = start_munged(root)
    wait_until("munged's socket", (root / "munge" / "munge.socket").exists, START_TIMEOUT_S, cluster)
    cluster.daemons["slurmctld"] = subprocess.Popen(["slurmctld", "-D", *conf], env=cluster.env, **quiet)
    for node in NODES:
        cluster.daemons[node] = subprocess.Popen(["slurmd", "-D", "-N", node, *conf], env=cluster.env, **quiet)

    def idle() -> bool:
        try:
            states = cluster.command("sinfo", "--noheader", "--Node", "--format=%N %t", timeout=5).split("\n")
        except (RuntimeError, subprocess.TimeoutExpired):
            return False
        return sorted(line.split()[0] for line in states if line.endswith(" idle")) == list(NODES)

    wait_until("both nodes idle", idle, START_TIMEOUT_S, cluster)


def stop(cluster: SlurmCluster) -> None:
    """Cancel every job (its steps end with it), then stop the daemons by pid."""
    if cluster.daemons.get("slurmctld") and cluster.daemons["slurmctld"].poll() is None:
        try:
            jobs = cluster.command("squeue", "--noheader", "--format=%A", timeout=10).split()
            if jobs:
                cluster.command("scancel", *jobs, timeout=10)
                wait_until("the jobs' end", lambda: not cluster.command("squeue", "--noheader"), 30, cluster)
        except (RuntimeError, TimeoutError, subprocess.TimeoutExpired):
            pass  # the daemons are stopped below all the same
    for name in (*NODES, "slurmctld", "munged"):
        proc = cluster.daemons.get(name)
        if proc is None:
            continue
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)


@contextmanager
def running_slurm_cluster(memory: bool = False) -> Iterator[SlurmCluster]:
    """A started 2-node cluster, stopped and removed at the end; `memory`: memory is scheduled too."""
    # Not under pytest's tmp folder: the munge user must reach the socket, and pytest's base is private.
    root = Path(tempfile.mkdtemp(prefix="mas-async-slurm-"))
    root.chmod(0o755)
    proctrack = "cgroup" if FREEZER.is_dir() else "linuxproc"
    cluster = SlurmCluster(root, {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}, proctrack, memory)
    try:
        start(cluster)
        yield cluster
    finally:
        stop(cluster)
        shutil.rmtree(root, ignore_errors=True)
