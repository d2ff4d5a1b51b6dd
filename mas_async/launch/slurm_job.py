"""`mas-async slurm`: write a run's SLURM batch script into its run directory and submit it with sbatch.

At submission the run's resolved config (with `cluster.engine=slurm` and `run.output_dir=RUN_DIR`) is
copied to RUN_DIR/config.yaml: every start of the job runs that copy. The job has one task per node and
asks each node for what the processes placed there need (`slurm_resources`: `--cpus-per-task`,
`--gpus-per-node`, `--mem`): with `--gpus-per-node N` (each node's GPUs) and no `--nodes`, as few nodes as
hold the steps' GPUs, one node when they fit one (`slurm_resources.nodes_for`). It may be requeued (`--requeue`), and SLURM warns its batch shell with SIGUSR1
`cluster.slurm.signal_before_s` seconds before the time limit, at most half its `--time`
(`--signal=B:USR1@N`). Its output is appended to RUN_DIR/slurm-JOBID.out, one block per start. Its
script, on the first node:

1. runs `python -m mas_async.launch.slurm_stale` once on every node (an srun step with one task per node;
   `SLURM_PROCID` is the node's index), which clears the processes and shared memory that earlier runs
   of the same job name left behind, and nothing else;
2. execs `python -m mas_async.launch.slurm_batch RUN_DIR`, which starts the run or resumes it from its
   newest checkpoint, stops it at a checkpoint on SIGUSR1 and requeues the job; its launcher places the
   roles on the nodes by index (`cluster.slurm.placement`) and starts each one as a step with resources of
   its own (`mas_async.launch.engines.slurm`).

The run directory must be on a file system that every node shares: the processes read the resolved
config and deployment.json there and write their logs, metrics and checkpoints there.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from mas_async.config import Config, ConfigError, dump_config
from mas_async.launch.engines.base import ProcessSpec
from mas_async.launch.engines.slurm import slurm_command
from mas_async.launch.launcher import process_specs
from mas_async.launch.slurm_batch import STOP_ENV
from mas_async.launch.slurm_resources import job_options, node_indexes, nodes_for, step_resources
from mas_async.launch.slurm_stale import JOB_NAME_ENV

SCRIPT_NAME = "slurm.sbatch"
SBATCH_TIMEOUT_S = 60.0
HEADER_WIDTH = 104
"""Width of the script's header lines that list each node's steps."""


@dataclass
class JobRequest:
    """What `mas-async slurm` was asked for."""

    config_path: Path
    overrides: list[str]
    nodes: int | None
    """`--nodes`; None: from `gpus_per_node` (`slurm_resources.nodes_for`)."""
    partition: str | None = None
    time: str | None = None
    job_name: str | None = None
    sbatch_args: list[str] = field(default_factory=list)
    """Extra `#SBATCH` options, e.g. --exclusive or --constraint=h100."""
    gpus_per_node: int | None = None
    """`--gpus-per-node`: the GPUs of each node of the partition (what the job may ask of one node)."""


def run_dir_of(config: Config) -> Path:
    """The run directory (absolute): `run.output_dir`, else runs/<run.name>/<date-time>."""
    if config.run.output_dir is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        return Path("runs", config.run.name, stamp).absolute()
    return Path(config.run.output_dir).absolute()


def job_name_of(request: JobRequest, config: Config) -> str:
    return request.job_name or f"mas-async-{config.run.name}"


def batch_script(request: JobRequest, config: Config, run_dir: Path) -> str:
    """The text of the batch script (see the module docstring)."""
    job_name = job_name_of(request, config)
    for what, value in (("--job-name", job_name), ("the run directory", str(run_dir))):
        if not value or any(c.isspace() or c in "'\"" for c in value):
            raise ConfigError(f"{what} {value!r}: #SBATCH lines cannot hold spaces or quotes")
    for index in config.cluster.slurm.placement.values():
        if request.nodes is not None and index >= request.nodes:
            raise ConfigError(
                f"cluster.slurm.placement names node index {index}, but the job has --nodes={request.nodes} "
                f"(indexes 0..{request.nodes - 1})"
            )
    python, q = sys.executable, shlex.quote
    specs = process_specs(config)
    nodes = nodes_for(config, specs, request.gpus_per_node, request.nodes)
    margin = signal_margin_s(config.cluster.slurm.signal_before_s, request.time)
    options = [
        f"--job-name={job_name}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        *job_options(config, specs, nodes),
        "--requeue",
        f"--signal=B:USR1@{margin}",
        "--open-mode=append",
        f"--chdir={Path.cwd()}",
        f"--output={run_dir}/slurm-%j.out",
        *([f"--partition={request.partition}"] if request.partition else []),
        *([f"--time={request.time}"] if request.time else []),
        *request.sbatch_args,
    ]
    clear = [python, "-m", "mas_async.launch.slurm_stale", "--job-name", job_name]
    batch = [python, "-m", "mas_async.launch.slurm_batch", str(run_dir)]
    lines = [
        "#!/bin/bash",
        "# A mas-async run on SLURM, written by `mas-async slurm` (docs/slurm.md); submit it again with",
        f"#   sbatch {run_dir / SCRIPT_NAME}",
        f"# config:  {request.config_path}, copied to {run_dir / 'config.yaml'}, which every start runs",
        f"# run dir: {run_dir} (on a file system every node shares)",
        *(
            [f"# nodes: {nodes}, the fewest of {request.gpus_per_node} GPUs each (--gpus-per-node) that hold the steps"]
            if request.nodes is None and request.gpus_per_node
            else []
        ),
        *(
            [
                f"# SIGUSR1 {margin} s before the time limit: half the job's --time={request.time} (signal_before_s is "
                f"{config.cluster.slurm.signal_before_s})"
            ]
            if margin != config.cluster.slurm.signal_before_s
            else []
        ),
        "# steps (each with CPUs and GPUs of its own; the job asks every node for the most that one needs):",
        *(f"#   {line}" for line in steps_by_node(config, specs, nodes)),
        *(f"#SBATCH {option}" for option in options),
        "set -euo pipefail",
        "",
        "# SIGUSR1 (SLURM's warning before the time limit) while this shell runs is passed on to the launcher,",
        "# which stops the run at a checkpoint and requeues the job.",
        "stop=0",
        "trap 'stop=1' USR1",
        "",
        "# Every process of the run carries the job name, so that a later job of this name finds what it left.",
        f"export {JOB_NAME_ENV}={q(job_name)}",
        "export PYTHONUNBUFFERED=1  # the launcher's lines reach the output file as they are written",
        'echo "mas-async: job $SLURM_JOB_ID, start $((${SLURM_RESTART_COUNT:-0} + 1)), on $SLURM_JOB_NODELIST"',
        "",
        "# 1. On every node (one task each, SLURM_PROCID = the node's index): stop the processes and remove",
        "#    the shared memory that earlier runs of this job name left behind; other job names are untouched.",
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 --job-name=clear-stale {shlex.join(clear)}",
        "",
        "# 2. The launcher, here on the first node: it starts the run, or resumes it from its newest checkpoint,",
        "#    placing the roles on the nodes by index (cluster.slurm.placement), each as a step of its own.",
        "trap '' USR1",
        f"{STOP_ENV}=$stop exec {shlex.join(batch)}",
        "",
    ]
    return "\n".join(lines)


def time_limit_s(text: str | None) -> int | None:
    """Seconds of a SLURM `--time` value (minutes, minutes:seconds, hours:minutes:seconds, days-hours,
    days-hours:minutes, days-hours:minutes:seconds); None for none, "infinite" or "unlimited"."""
    if not text or text.lower() in ("infinite", "unlimited"):
        return None
    days, _, clock = text.rpartition("-")
    parts = [int(x) for x in clock.split(":")]
    if days:  # days-hours[:minutes[:seconds]]
        hours, minutes, seconds = (parts + [0, 0])[:3]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


def signal_margin_s(signal_before_s: int, time: str | None) -> int:
    """When SLURM warns the job before its time limit: `signal_before_s`, but at most half the job's `--time`
    when that is given (a margin as long as the job would have it warned as it starts, and stopped after every
    first step); the launcher's own watch (`slurm_time_limit`) stops the run earlier when it must."""
    limit = time_limit_s(time)
    return signal_before_s if limit is None else min(signal_before_s, limit // 2)


def steps_by_node(config: Config, specs: list[ProcessSpec], node_count: int) -> list[str]:
    """One line per node: what each of its processes' steps holds, for the script's header."""
    where = node_indexes(config, specs, node_count)
    lines = []
    for index in range(node_count):
        held = []
        for spec in (s for s in specs if where[s.name] == index):
            res = step_resources(config, spec)
            held.append(
                f"{spec.name} ({res.cpus} CPU{'s' if res.cpus > 1 else ''}"
                + (f", {res.gpus} GPU)" if res.gpus else ")")
            )
        line = f"node {index}:"
        for item in held or ["nothing but the clearing step"]:
            if len(line) + len(item) + 2 > HEADER_WIDTH:
                lines.append(line)
                line = " "
            line += f" {item},"
        lines.append(line.rstrip(","))
    return lines


def write_batch_script(request: JobRequest, config: Config) -> Path:
    """Write the batch script and the run's config into the run directory (created; it must not hold a
    run yet); the script's path."""
    run_dir = run_dir_of(config)
    if (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"run directory {run_dir} already holds a run; choose another run.output_dir")
    config.cluster.engine = "slurm"
    config.run.output_dir = str(run_dir)
    text = batch_script(request, config, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(config, run_dir / "config.yaml")
    path = run_dir / SCRIPT_NAME
    path.write_text(text)
    path.chmod(0o755)
    return path


def submit(script: Path) -> str:
    """Submit the batch script with sbatch; the job id."""
    out = slurm_command(["sbatch", "--parsable", str(script)], SBATCH_TIMEOUT_S)
    return out.strip().split(";")[0]
