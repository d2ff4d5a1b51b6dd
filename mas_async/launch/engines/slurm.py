"""The SLURM engine (`cluster.engine: slurm`): inside an allocation, every process of the run is a job step
on its node, started with `srun` by the launcher (which itself runs in the batch step on the first node).

Nodes are the allocation's (`scontrol show hostnames $SLURM_JOB_NODELIST`), each at its `NodeAddr`
resolved to an IP; `cluster.slurm.placement` puts a role or one process on a node by index (defaults in
`slurm_resources.node_indexes`). A process is `srun --exact -N1 -n1 -w NODE --cpus-per-task=C
(--gpus-per-task=G | --gres=none) --mem=0 --kill-on-bad-exit=1 --immediate=T --job-name=NAME sh -c '<write
JOB.STEP and pid>; exec COMMAND'`, run by the launcher in its own session with its output (the step's and
srun's own errors) in the process's log: each step holds CPUs and GPUs of its own (`slurm_resources`), so
a GPU process sees only its own GPUs, from cuda:0 (its GPU view is its own, for `mas_async.placement`). srun
runs without the job's resource variables (they would be every step's defaults), and a step that cannot
get its resources within `command_timeout_s` fails with srun's reason instead of waiting.

Stopping a step (checked on slurm-wlm 22.05, docs/slurm.md): SIGTERM to srun does not reach the task,
srun "forces job termination" and the step is SIGKILLed at once; so a graceful stop is `scancel
--signal=TERM JOB.STEP` (the task gets SIGTERM), a hard one is SIGTERM to srun. SIGKILL to srun leaves
the step running until SLURM notices, so it is only the last resort of `close`. With
`ProctrackType=proctrack/cgroup` the end of a step kills every process it started, double-forked ones too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from mas_async.config import Config, ConfigError
from mas_async.launch.engines.base import Child, Engine, Node, ProcessSpec
from mas_async.launch.slurm_resources import (
    gpus_of,
    node_indexes,
    step_environment,
    step_options,
    step_resources,
)

STEP_FILE_ENV = "MAS_ASYNC_STEP_FILE"
# Run as the step's task: records "JOB.STEP PID" for signals and pids.json, then becomes the command.
STEP_WRAPPER = f'echo "$SLURM_JOB_ID.$SLURM_STEP_ID $$" > "${STEP_FILE_ENV}" && exec "$@"'
PID_WAIT_S = 10.0
"""How long `SlurmChild.pid` waits for a running step to record its pid."""


class SlurmCommandError(RuntimeError):
    """A SLURM command failed or did not answer in time; the message names the command."""


def slurm_command(args: list[str], timeout: float) -> str:
    """Run a SLURM command; its stdout, or SlurmCommandError naming it with its stderr (or the timeout)."""
    if shutil.which(args[0]) is None:
        raise SlurmCommandError(f"{args[0]} is not installed here (cluster.engine=slurm needs SLURM's commands)")
    try:
        out = subprocess.run(
            args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
            env=step_environment(dict(os.environ)),  # an srun step asks for its own resources only
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise SlurmCommandError(f"`{' '.join(args)}` did not finish in {timeout:.0f} s") from None
    if out.returncode != 0:
        raise SlurmCommandError(f"`{' '.join(args)}` failed (status {out.returncode}): {out.stderr.strip()}")
    return out.stdout


def allocation_nodes(nodelist: str, timeout: float) -> list[Node]:
    """The allocation's nodes in SLURM's order, each at its NodeAddr resolved to an IP."""
    names = slurm_command(["scontrol", "show", "hostnames", nodelist], timeout).split()
    addresses = {}
    for line in slurm_command(["scontrol", "show", "node", "--oneliner", nodelist], timeout).splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "NodeName" in fields:
            addresses[fields["NodeName"]] = fields.get("NodeAddr", fields["NodeName"])
    nodes = []
    for name in names:
        address = addresses.get(name, name)
        try:
            nodes.append(Node(name, socket.gethostbyname(address)))
        except OSError as e:
            raise SlurmCommandError(f"node {name}: its NodeAddr {address!r} does not resolve: {e}") from None
    return nodes


class SlurmChild(Child):
    """A process running as a job step; signals go through SLURM (see the module docstring)."""

    def __init__(
        self, name: str, node: Node, log_path: Path, srun: subprocess.Popen, step_file: Path, timeout: float
    ) -> None:
        super().__init__(name, node, log_path)
        self.srun = srun
        self.step_file = step_file
        self.timeout = timeout
        self._step: tuple[str, int] | None = None

    def step(self) -> tuple[str, int] | None:
        """(JOB.STEP, pid on its node) once the step's task recorded them; None before (or if it never did).
        Waits up to PID_WAIT_S while srun runs."""
        deadline = time.monotonic() + PID_WAIT_S
        while self._step is None:
            try:
                step_id, pid = self.step_file.read_text().split()
                self._step = (step_id, int(pid))
            except (OSError, ValueError):  # not written yet, or half-written
                if self.srun.poll() is not None or time.monotonic() > deadline:
                    return None
                time.sleep(0.05)
        return self._step

    @property
    def pid(self) -> int | None:
        step = self.step()
        return step[1] if step else None

    def poll(self) -> int | None:
        return self.srun.poll()

    def terminate(self) -> None:
        if self.srun.poll() is not None:
            return
        step = self.step()
        if step is None:  # no step id: srun's own SIGTERM handling ends the step (hard)
            _signal(self.srun.pid, signal.SIGTERM)
            return
        # scancel may say "Invalid job id specified" for a step although the task got the signal: the
        # result is the step's exit, which the launcher waits for.
        try:
            subprocess.run(
                ["scancel", "--signal=TERM", step[0]], capture_output=True, timeout=self.timeout, check=False
            )
        except subprocess.TimeoutExpired:
            _signal(self.srun.pid, signal.SIGTERM)

    def kill(self) -> None:
        # SIGTERM makes srun SIGKILL the step (every process of its cgroup) and exit once it is gone.
        if self.srun.poll() is None:
            _signal(self.srun.pid, signal.SIGTERM)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.srun.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


class SlurmEngine(Engine):
    """Runs the processes of a run as steps of the SLURM job it is started in (see the module docstring)."""

    def __init__(self, config: Config) -> None:
        self.job_id = os.environ.get("SLURM_JOB_ID")
        nodelist = os.environ.get("SLURM_JOB_NODELIST")
        if not self.job_id or not nodelist:
            raise ConfigError(
                "cluster.engine=slurm runs inside a SLURM allocation (SLURM_JOB_ID and SLURM_JOB_NODELIST are "
                "not set): submit the run with `mas-async slurm CONFIG --nodes N`, or start it in `salloc`"
            )
        self.config = config
        self.settings = config.cluster.slurm
        self.timeout = self.settings.command_timeout_s
        self.nodes = allocation_nodes(nodelist, self.timeout)
        self.children: list[SlurmChild] = []

    @classmethod
    def planning(cls, config: Config, node_count: int) -> SlurmEngine:
        """An engine that only places, outside an allocation (`mas-async train --dry-run`): `node_count`
        nodes named node0.. by index, their addresses unknown until the job runs."""
        engine = cls.__new__(cls)
        engine.job_id, engine.config, engine.settings = None, config, config.cluster.slurm
        engine.timeout, engine.children = engine.settings.command_timeout_s, []
        engine.nodes = [Node(f"node{i}", "(its NodeAddr)") for i in range(node_count)]
        return engine

    def place(self, specs: list[ProcessSpec]) -> dict[str, Node]:
        for spec in specs:  # a device the step would not hold is refused before anything starts
            step_resources(self.config, spec)
        return {name: self.nodes[index] for name, index in node_indexes(self.config, specs, len(self.nodes)).items()}

    def gpu_view(self, spec: ProcessSpec, node: Node) -> str:
        """A step with GPUs sees only its own: its numbering is its own (two steps never share a GPU)."""
        return spec.name if gpus_of(self.config, spec) else node.name

    def free_ports(self, node: Node, count: int) -> list[int]:
        code = (
            "import json; from mas_async.deployment import free_ports; "
            f"print(json.dumps(free_ports({node.address!r}, {count})))"
        )
        # srun's stdout is the task's output only (its own messages go to stderr). A short step beside the
        # others (--overlap), also while the steps of a run being restarted still hold their resources.
        share = ["--overlap", "--gres=none"]
        out = slurm_command([*self._srun(node, "free-ports"), *share, sys.executable, "-c", code], self.timeout)
        return json.loads(out.strip().splitlines()[-1])

    def start(self, spec: ProcessSpec, node: Node, command: list[str], env: dict[str, str], log_path: Path) -> Child:
        step_file = log_path.with_suffix(".step")
        step_file.unlink(missing_ok=True)
        extra = [*self.settings.step_args.get(spec.role, []), *self.settings.step_args.get(spec.name, [])]
        resources = step_options(step_resources(self.config, spec))
        immediate = f"--immediate={max(1, round(self.timeout))}"  # no step waits unbounded for its resources
        srun = [*self._srun(node, spec.name), *resources, immediate, *extra]
        srun += ["sh", "-c", STEP_WRAPPER, "mas-async-step", *command]
        with log_path.open("ab") as log_file:
            proc = subprocess.Popen(
                srun,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches the launcher only; it stops the steps
                env={**step_environment(dict(os.environ)), **env, STEP_FILE_ENV: str(step_file)},
            )
        child = SlurmChild(spec.name, node, log_path, proc, step_file, self.timeout)
        self.children.append(child)
        return child

    def close(self) -> None:
        """The launcher has stopped the children; an srun that still runs is ended here, its step with it."""
        for child in self.children:
            child.kill()
        deadline = time.monotonic() + self.timeout
        for child in self.children:
            if child.wait(max(0.0, deadline - time.monotonic())) is None:
                _signal(child.srun.pid, signal.SIGKILL)  # SLURM ends the step when the job ends
                child.wait(5.0)

    def _srun(self, node: Node, name: str) -> list[str]:
        return [
            "srun", "--nodes=1", "--ntasks=1", f"--nodelist={node.name}", "--kill-on-bad-exit=1",
            f"--job-name={name}", f"--jobid={self.job_id}",
        ]  # fmt: skip
