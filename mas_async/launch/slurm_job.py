"""`mas-async slurm`: write a run's SLURM batch script into its run directory and submit it with sbatch.

The job has one task per node (`--ntasks-per-node=1`). Its script, on the first node:

1. runs `python -m mas_async.launch.slurm_stale` once on every node (an srun step with one task per node;
   `SLURM_PROCID` is the node's index), which clears the processes and shared memory that earlier runs
   of the same job name left behind, and nothing else;
2. execs the launcher, `python -m mas_async train CONFIG ... cluster.engine=slurm run.output_dir=RUN_DIR`,
   which places the roles on the nodes by index (`cluster.slurm.placement`) and starts each one as an
   `srun --overlap` step on its node (`mas_async.launch.engines.slurm`).

The run directory must be on a file system that every node shares: the processes read the resolved
config and deployment.json there and write their logs and metrics there.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from mas_async.config import Config, ConfigError
from mas_async.launch.engines.slurm import slurm_command
from mas_async.launch.slurm_stale import JOB_NAME_ENV

SCRIPT_NAME = "slurm.sbatch"
SBATCH_TIMEOUT_S = 60.0


@dataclass
class JobRequest:
    """What `mas-async slurm` was asked for."""

    config_path: Path
    overrides: list[str]
    nodes: int
    partition: str | None = None
    time: str | None = None
    job_name: str | None = None
    sbatch_args: list[str] = field(default_factory=list)
    """Extra `#SBATCH` options, e.g. --gpus-per-node=8 or --exclusive."""


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
        if index >= request.nodes:
            raise ConfigError(
                f"cluster.slurm.placement names node index {index}, but the job has --nodes={request.nodes} "
                f"(indexes 0..{request.nodes - 1})"
            )
    python, q = sys.executable, shlex.quote
    options = [
        f"--job-name={job_name}",
        f"--nodes={request.nodes}",
        "--ntasks-per-node=1",
        f"--chdir={Path.cwd()}",
        f"--output={run_dir}/slurm-%j.out",
        *([f"--partition={request.partition}"] if request.partition else []),
        *([f"--time={request.time}"] if request.time else []),
        *request.sbatch_args,
    ]
    train = [
        python, "-m", "mas_async", "train", str(request.config_path.absolute()),
        *(o for o in request.overrides if not o.startswith("run.output_dir=")),
        "cluster.engine=slurm", f"run.output_dir={run_dir}",
    ]  # fmt: skip
    clear = [python, "-m", "mas_async.launch.slurm_stale", "--job-name", job_name]
    lines = [
        "#!/bin/bash",
        "# A mas-async run on SLURM, written by `mas-async slurm` (docs/slurm.md); submit it again with",
        f"#   sbatch {run_dir / SCRIPT_NAME}",
        f"# config:  {request.config_path}",
        f"# run dir: {run_dir} (on a file system every node shares)",
        *(f"#SBATCH {option}" for option in options),
        "set -euo pipefail",
        "",
        "# Every process of the run carries the job name, so that a later job of this name finds what it left.",
        f"export {JOB_NAME_ENV}={q(job_name)}",
        "",
        "# 1. On every node (one task each, SLURM_PROCID = the node's index): stop the processes and remove",
        "#    the shared memory that earlier runs of this job name left behind; other job names are untouched.",
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 --job-name=clear-stale {shlex.join(clear)}",
        "",
        "# 2. The launcher, here on the first node: it places the roles on the nodes by index",
        "#    (cluster.slurm.placement) and starts each one as an `srun --overlap` step on its node.",
        f"exec {shlex.join(train)}",
        "",
    ]
    return "\n".join(lines)


def write_batch_script(request: JobRequest, config: Config) -> Path:
    """Write the batch script into the run directory (created; it must not hold a run yet); its path."""
    run_dir = run_dir_of(config)
    if (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"run directory {run_dir} already holds a run; choose another run.output_dir")
    text = batch_script(request, config, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / SCRIPT_NAME
    path.write_text(text)
    path.chmod(0o755)
    return path


def submit(script: Path) -> str:
    """Submit the batch script with sbatch; the job id."""
    out = slurm_command(["sbatch", "--parsable", str(script)], SBATCH_TIMEOUT_S)
    return out.strip().split(";")[0]
