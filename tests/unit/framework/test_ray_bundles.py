"""The Ray engine's bundles and config, without Ray: each process reserves its role's CPUs and GPUs plus the
custom resources of its role and its own name; mistakes in `cluster.ray` name the key."""

from __future__ import annotations

import pytest

from mas_async.config import ConfigError, load_config
from mas_async.launch.engines.ray import RayEngine, bundle_of
from mas_async.launch.launcher import process_specs
from tests.support.paths import ROOT

CONFIG = ROOT / "configs" / "plan_path_tiny.yaml"


def _bundles(*overrides: str) -> dict[str, dict[str, float]]:
    config = load_config(CONFIG, ["cluster.engine=ray", *overrides])
    return {spec.name: bundle_of(config, spec) for spec in process_specs(config)}


def test_every_process_reserves_one_cpu_by_default_and_no_gpu():
    bundles = _bundles()
    assert list(bundles) == [
        "router",
        "trainer/vertical",
        "inference/vertical/0",
        "trainer/horizontal",
        "inference/horizontal/0",
        "env_worker/0",
        "env_worker/1",
    ]
    assert all(b == {"CPU": 1.0} for b in bundles.values())


def test_role_resources_and_a_process_own_add_up():
    bundles = _bundles(
        "cluster.ray.trainer_gpus=1",
        "cluster.ray.inference_cpus=2",
        "cluster.ray.inference_gpus=0.5",
        "cluster.ray.resources.inference.node_b=1",
        "cluster.ray.resources.inference/horizontal/0.node_b=0",  # a process's entry overrides its role's
        "cluster.ray.resources.inference/horizontal/0.big_gpu=1",
    )
    assert bundles["trainer/vertical"] == {"CPU": 1.0, "GPU": 1.0}
    assert bundles["inference/vertical/0"] == {"CPU": 2.0, "GPU": 0.5, "node_b": 1.0}
    assert bundles["inference/horizontal/0"] == {"CPU": 2.0, "GPU": 0.5, "big_gpu": 1.0}
    assert bundles["env_worker/0"] == bundles["router"] == {"CPU": 1.0}


def test_gpu_processes_reserve_what_they_compute_on_by_default_as_on_every_engine():
    """`config.scheduler_gpus`: the rule SLURM steps and the local engine follow too; 0 keeps none reserved."""
    bundles = _bundles(
        "policies.vertical.device=cuda", "policies.horizontal.backend=vllm",
        "policies.horizontal.vllm.tensor_parallel_size=2",
    )  # fmt: skip
    assert bundles["trainer/vertical"] == bundles["inference/vertical/0"] == {"CPU": 1.0, "GPU": 1.0}
    assert bundles["inference/horizontal/0"] == {"CPU": 1.0, "GPU": 2.0}  # its tensor parallel size
    assert bundles["trainer/horizontal"] == bundles["router"] == {"CPU": 1.0}  # on the CPU
    assert _bundles("policies.vertical.device=cuda", "cluster.ray.trainer_gpus=0")["trainer/vertical"] == {"CPU": 1.0}


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("cluster.ray.resources.routr.node_a=1", "cluster.ray.resources.routr: not a role or process"),
        ("cluster.ray.address=local", "cluster.ray.address=local would start a Ray instance"),
        ("cluster.ray.strategy=RANDOM", "cluster.ray.strategy"),
        ("cluster.ray.trainer_cpus=0", "cluster.ray.trainer_cpus"),
    ],
)
def test_mistakes_in_cluster_ray_name_the_key(override, named):
    with pytest.raises(ConfigError, match=named):
        load_config(CONFIG, ["cluster.engine=ray", override])


def test_the_local_engine_placement_is_refused_before_connecting():
    config = load_config(CONFIG, ["cluster.engine=ray", "cluster.placement.router=local"])
    with pytest.raises(ConfigError, match="cluster.placement are the local engine's"):
        RayEngine(config)
