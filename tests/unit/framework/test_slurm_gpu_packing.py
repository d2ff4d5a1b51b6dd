"""The GPUs a SLURM job asks for are the GPUs its steps use: `mas-async slurm` packs the steps with GPUs onto
as few nodes as hold them (`--gpus-per-node N`: each node's GPUs), each policy's trainer beside its
servers, and asks every node for the most that one node's steps hold, so no GPU is allocated idle and no
weight broadcast crosses the network where one node holds a policy. Without a cluster (the batch script
of --dry-run); tests/integration/test_slurm.py runs the packed steps on a real one."""

from __future__ import annotations

import re

import pytest

from mas_async.config import load_config
from mas_async.launch.cli import main
from mas_async.launch.launcher import process_specs
from mas_async.launch.slurm_resources import node_indexes, step_resources
from tests.support.paths import ROOT

QWEN = str(ROOT / "configs/plan_path_qwen3_1.7b.yaml")  # per policy 1 trainer and 3 vLLM servers: 8 GPUs


def _submit(tmp_path, capsys, *args: str) -> dict[str, str]:
    """The script's resource options of `mas-async slurm QWEN ARGS --dry-run`, by name."""
    rc = main(["slurm", QWEN, *args, "--dry-run", f"run.output_dir={tmp_path / 'run'}"])
    assert rc == 0, capsys.readouterr().err
    text = (tmp_path / "run" / "slurm.sbatch").read_text()
    options = [line.removeprefix("#SBATCH --") for line in text.splitlines() if line.startswith("#SBATCH --")]
    return dict(option.split("=", 1) for option in options if "=" in option)


def _gpus_by_node(overrides: list[str], nodes: int) -> list[dict[str, int]]:
    """Per node index: process -> its step's GPUs."""
    config = load_config(QWEN, ["cluster.engine=slurm", *overrides])
    specs = process_specs(config)
    where = node_indexes(config, specs, nodes)
    found: list[dict[str, int]] = [{} for _ in range(nodes)]
    for spec in specs:
        if gpus := step_resources(config, spec).gpus:
            found[where[spec.name]][spec.name] = gpus
    return found


def test_a_run_that_fits_one_node_is_one_node_of_exactly_its_gpus(tmp_path, capsys):
    options = _submit(tmp_path, capsys, "--gpus-per-node", "8")
    assert (options["nodes"], options["gpus-per-node"]) == ("1", "8")  # 8 allocated, 8 used


def test_two_nodes_ask_for_the_gpus_the_steps_use_each_policy_on_a_node_of_its_own(tmp_path, capsys):
    options = _submit(tmp_path, capsys, "--nodes", "2")
    assert int(options["nodes"]) * int(options["gpus-per-node"]) == 8  # was 2 x 6: 4 GPUs idle
    node0, node1 = _gpus_by_node([], 2)
    assert sorted(node0) == ["inference/tool/0", "inference/tool/1", "inference/tool/2", "trainer/tool"]
    assert sorted(node1) == ["inference/plan/0", "inference/plan/1", "inference/plan/2", "trainer/plan"]


def test_more_gpus_than_a_node_holds_take_as_few_nodes_as_hold_them(tmp_path, capsys):
    replicas = ["policies.tool.replicas=5", "policies.plan.replicas=5"]  # 12 GPUs on nodes of 8
    options = _submit(tmp_path, capsys, "--gpus-per-node", "8", *replicas)
    assert (options["nodes"], options["gpus-per-node"]) == ("2", "6")
    assert [sum(node.values()) for node in _gpus_by_node(replicas, 2)] == [6, 6]
    # 13 GPUs, servers of 2 (tensor parallel, never split) on nodes of 6: 3 nodes of 5, 5 and 3.
    tp = ["policies.tool.vllm.tensor_parallel_size=2", "policies.tool.replicas=3", "policies.plan.replicas=5"]
    options = _submit(tmp_path, capsys, "--gpus-per-node", "6", *tp)
    assert (options["nodes"], options["gpus-per-node"]) == ("3", "5")
    assert sorted(sum(node.values()) for node in _gpus_by_node(tp, 3)) == [3, 5, 5]


def test_an_explicit_placement_counts_against_its_node(tmp_path, capsys):
    """Both trainers pinned to node 1: the servers fill node 0 and what node 1 has left, 4 GPUs each."""
    pinned = ["cluster.slurm.placement={trainer: 1}"]
    node0, node1 = _gpus_by_node(pinned, 2)
    assert set(node1) >= {"trainer/tool", "trainer/plan"}
    assert sum(node0.values()) == sum(node1.values()) == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus-per-node", "8", "policies.tool.vllm.tensor_parallel_size=16"],
         r"inference/tool/0 needs 16 GPUs .*, more than a node has \(--gpus-per-node 8\)"),
        (["--nodes", "1", "--gpus-per-node", "4"],
         r"on 1 node\(s\) the steps need 8 GPUs on one node, more than its 4 \(--gpus-per-node 4\): "
         r"leave --nodes out \(2 nodes hold them\)"),
    ],
)  # fmt: skip
def test_steps_that_do_not_fit_the_nodes_are_refused_with_the_fix(tmp_path, capsys, args, message):
    rc = main(["slurm", QWEN, *args, "--dry-run", f"run.output_dir={tmp_path}"])
    assert rc == 2
    assert re.search(message, capsys.readouterr().err)
