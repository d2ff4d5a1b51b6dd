"""A run whose disk fills (a small tmpfs as its run directory): the first write that finds no space stops the run
at once with `DiskFull`, naming the path, not a restart that would fill it again; the last complete checkpoint
stays loadable and no half-written one is taken for complete; with room again, `resume=RUN_DIR` continues from
that checkpoint, every iteration's row once."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from mas_async.checkpoint import STATE, complete_versions, policy_checkpoint
from tests.integration.launch import FAST, run_train

CONFIG = "configs/plan_path_tiny.yaml"
SMALL_MB = 10
"""Room for the run's start and a few checkpoints of two tiny policies (about 1 MB each), not for all of them."""
ITERATIONS = 16
"""A checkpoint each: about 40 MB in all."""


@pytest.fixture
def small_disk(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_MB}m", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_stops_the_run_with_a_named_error_and_resume_continues_from_the_last_checkpoint(small_disk):
    run_dir = small_disk / "run"
    settings = [*FAST, "eval.every=0", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=0",
                "trainer.keep_best=false", "cluster.max_restarts=5"]  # fmt: skip
    rc, out = run_train(CONFIG, run_dir, f"run.iterations={ITERATIONS}", *settings, timeout=300)
    assert rc != 0, out
    assert "DiskFull: " in out and "no space left writing" in out and str(small_disk) in out, out
    assert "restarting the run" not in out, out  # a restart would fill the disk again
    policies = ["vertical", "horizontal"]
    versions = complete_versions(run_dir, policies)
    assert versions, out
    last = versions[-1]
    for policy in policies:  # the last complete checkpoint is whole: a model folder with its trainer state
        folder = policy_checkpoint(run_dir, policy, last)
        assert (folder / STATE).exists() and (folder / "config.json").exists()
        leftovers = [p.name for p in folder.parent.iterdir() if p.name.startswith(".")]
        assert not leftovers, leftovers  # a failed checkpoint's temporary files are gone
    assert last < ITERATIONS - 1, out  # the disk filled before the run's end
    subprocess.run(["mount", "-o", "remount,size=100m", str(small_disk)], check=True)
    rc, out = run_train(CONFIG, run_dir, f"resume={run_dir}", timeout=300)
    assert rc == 0, out
    assert f"resuming {run_dir} from its checkpoint of version {last}" in out, out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(ITERATIONS + 1)), [r["iteration"] for r in rows]
    assert all(v == 0 for r in rows for k, v in r.items() if k.endswith("/version_mismatch"))
