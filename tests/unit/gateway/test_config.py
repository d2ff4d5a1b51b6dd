"""The config of a workflow program (`workflow.program`): what it needs and what it refuses, in a sentence."""

from __future__ import annotations

import pytest

from mas_async.config import ConfigError, load_config
from tests.support.paths import ROOT

EXAMPLE = ROOT / "configs" / "examples" / "openai_movers.yaml"


def test_the_example_config_is_a_program_with_node_less_agents() -> None:
    config = load_config(EXAMPLE)
    assert config.uses_gateway() and config.workflow.name is None
    assert all(spec.node is None for spec in config.agents.values())
    assert not load_config(ROOT / "configs" / "plan_path_tiny.yaml").uses_gateway()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["workflow.name=plan_path"], "exactly one of name"),
        (["workflow.program=nodes.examples.openai_movers"], "'module:function'"),
        (["agents.vertical.node=plan_path_vertical"], r"agents \['vertical'\] name a node"),
        (["algorithm.sampling=tree"], "set algorithm.sampling=parallel"),
        (["eval.baselines=true"], "set eval.baselines=false"),
        (["gateway.max_calls_per_episode=0"], "gateway.max_calls_per_episode"),
    ],
)
def test_a_program_config_refuses_what_cannot_work(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(EXAMPLE, overrides)


def test_agent_turn_groups_under_parallel_sampling_are_allowed_for_a_program_only() -> None:
    load_config(EXAMPLE, ["algorithm.sampling=parallel", "algorithm.grouping=agent_turn"])
    with pytest.raises(ConfigError, match="agent_turn groups would hold one sample each"):
        load_config(ROOT / "configs" / "plan_path_tiny.yaml", ["algorithm.sampling=parallel"])
    with pytest.raises(ConfigError, match="name no node"):
        load_config(ROOT / "configs" / "plan_path_tiny.yaml", ["agents.vertical.node=null"])
