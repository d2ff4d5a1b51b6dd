"""A SLURM run where memory is a consumable resource (`SelectTypeParameters=CR_Core_Memory` and a
`DefMemPerGPU`, as on most GPU clusters), on the real 2-node test cluster (tests/integration/slurm_cluster.py):
the job asks less memory than its nodes have, and every process of the run still runs as its step at once,
none waiting for memory another step took (each asks `--mem=0`: the job's memory, taken from no other step;
mas_async/launch/slurm_resources.py). Its own module, so that its cluster runs after test_slurm.py's has
stopped (two clusters at once would share job ids and their cgroups)."""

from __future__ import annotations

import pytest

from tests.integration.slurm_cluster import running_slurm_cluster, skip_reason
from tests.integration.test_slurm import every_step_at_once

pytestmark = [pytest.mark.slurm, pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")]


@pytest.fixture(scope="module")
def memory_cluster():
    with running_slurm_cluster(memory=True) as cluster:
        yield cluster


def test_every_step_runs_at_once_where_memory_is_scheduled(memory_cluster, tmp_path, monkeypatch):
    resources = every_step_at_once(memory_cluster, tmp_path, monkeypatch, "cluster.slurm.mem_per_node=8000M")
    assert {"--mem=8000M", "--gpus-per-node=2"} <= set(resources)  # half of each node's 16000 MB
    steps = memory_cluster.command("scontrol", "show", "config")
    assert "CR_CORE_MEMORY" in steps.upper() and "DefMemPerGPU=4000" in steps
