"""The Weights & Biases sink of the metrics writer (`metrics.wandb`), used by the router only.

Every row that the router appends to metrics.jsonl is logged to one W&B run as it is: the same keys
(`iteration` included, and made the x-axis of every chart) and the same values, with the resolved config
as the run's config. `mode: offline` needs no network: W&B writes the run into
RUN_DIR/wandb/offline-run-<time>-<id>/ and `wandb sync` uploads that folder later.

`wandb` costs about a second of CPU to import, so it is imported here, when a run asks for W&B, and
never by a run that does not (the router imports this module, not wandb).

The run's W&B id is kept in RUN_DIR/wandb/run-id: a router restarted after a lost process, or a run
resumed with `resume=RUN_DIR`, logs to the same W&B run. The rows a resumed run writes again (those after
its last checkpoint, see `metrics.keep_rows_before`) are logged again too; metrics.jsonl keeps one row per
iteration, W&B shows both points at that iteration.
"""

from __future__ import annotations

import secrets
import string
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mas_async.config import Config, WandbConfig

WANDB_DIR = "wandb"
"""W&B's folder under the run directory (its offline-run-* and run-* folders, and run-id)."""
RUN_ID_FILE = "run-id"


class WandbError(RuntimeError):
    """W&B could not start the run (for example online without credentials); the message says what to do."""


class WandbRun:
    """One W&B run for a run directory: `log(row)` per iteration, `finish()` at the end."""

    def __init__(self, settings: WandbConfig, config: Config, run_dir: Path, *, job_type: str = "train") -> None:
        import wandb  # here, not at the top: a run without W&B never pays for the import

        self._wandb = wandb
        folder = run_dir / WANDB_DIR
        folder.mkdir(parents=True, exist_ok=True)
        run_id = _run_id(folder)
        try:
            self._run = wandb.init(
                project=settings.project,
                entity=settings.entity,
                mode=settings.mode,
                name=settings.name or default_name(config, run_dir),
                group=settings.group,
                tags=settings.tags,
                notes=settings.notes,
                job_type=job_type,
                config=config.model_dump(mode="json"),
                dir=str(run_dir),
                id=run_id,
                resume="allow",
                # The router's output is its log file (RUN_DIR/logs/router.log); W&B need not copy it.
                settings=wandb.Settings(console="off"),
            )
        except Exception as e:  # wandb raises several types (UsageError, CommError, ...): one sentence here
            hint = (
                "log in with `wandb login` or set WANDB_API_KEY for the router, or use metrics.wandb.mode=offline "
                "and `wandb sync` later"
                if settings.mode == "online"
                else "metrics.wandb.mode=offline writes only into the run directory; is it writable?"
            )
            raise WandbError(
                f"metrics.wandb: W&B could not start run {run_id} ({type(e).__name__}: {e}); {hint}"
            ) from e
        # Charts against the iteration, not W&B's own step counter (which also counts rows logged again).
        self._run.define_metric("*", step_metric="iteration")

    @property
    def folder(self) -> Path:
        """This process's W&B run folder (offline-run-* or run-*), holding run-<id>.wandb."""
        return Path(self._run.dir).parent

    def log(self, row: dict[str, Any]) -> None:
        self._run.log(dict(row))

    def finish(self) -> None:
        """End the run and W&B's service process: `finish()` returns before the service has written the run
        file (it can still hold only its header), `teardown()` waits until it has. The router is the only
        user of W&B in its process, so ending the service is safe."""
        self._run.finish()
        self._wandb.teardown()


def default_name(config: Config, run_dir: Path) -> str:
    """`<run.name>-<run directory's folder name>` (e.g. plan_path_tiny-20261203-101500), or run.name alone
    when the folder has that name."""
    return config.run.name if run_dir.name == config.run.name else f"{config.run.name}-{run_dir.name}"


def _run_id(folder: Path) -> str:
    """The run directory's W&B id: read from `folder`/run-id, or made now (8 characters of [a-z0-9], as W&B's
    own ids) and written there."""
    path = folder / RUN_ID_FILE
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    tmp = path.with_name(f".{RUN_ID_FILE}.tmp")
    tmp.write_text(run_id + "\n")
    tmp.replace(path)
    return run_id
