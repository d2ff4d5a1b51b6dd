"""The config of a workflow program (`workflow.program`): what it needs and what it refuses, in a sentence."""

from __future__ import annotations

import pytest

from mas_async.config import ConfigError, load_config
from tests.support.paths import ROOT

EXAMPLE = ROOT / "configs" / "examples" / "openai_movers.yaml"
TREE = ROOT / "configs" / "examples" / "openai_movers_tree.yaml"


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
        (["algorithm.sampling=tree"], "algorithm.sampling=tree with workflow.program needs workflow.scorer"),
        (["workflow.scorer=nodes.examples.openai_movers:score"], "algorithm.sampling=parallel samples one choice"),
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


def test_tree_sampling_of_a_program_needs_a_scorer_and_reaches_the_gateway() -> None:
    from mas_async.gateway.sampling import Limits
    from mas_async.gateway.tree import TreeSampling

    config = load_config(TREE, ["algorithm.k=3", "rollout.request_timeout_s=7"])
    assert config.algorithm.sampling == "tree" and config.workflow.scorer == "nodes.examples.openai_movers:score"
    assert Limits.of(config).tree == TreeSampling(3, "nodes.examples.openai_movers:score", 7.0)
    assert Limits.of(load_config(EXAMPLE)).tree is None  # parallel sampling: each call samples its own n
    for overrides, match in [
        (["workflow.scorer=null"], "needs workflow.scorer .'module:function', async def score"),
        (["workflow.scorer=nodes.examples.openai_movers"], "workflow.scorer is 'nodes.examples.openai_movers': give"),
        (["algorithm.sampling=parallel"], "drop workflow.scorer or set algorithm.sampling=tree"),
        (["algorithm.grouping=trajectory"], "algorithm.grouping=trajectory compares"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(TREE, overrides)
    with pytest.raises(ConfigError, match="workflow.name='plan_path' plays nodes, .* drop workflow.scorer"):
        load_config(ROOT / "configs" / "plan_path_tiny.yaml", ["workflow.scorer=nodes.examples.openai_movers:score"])


def test_agents_that_are_not_the_envs_are_refused_naming_the_envs_agents(tmp_path, capsys) -> None:
    """A team whose agent names the env does not know fails at the config check (and `--dry-run`), not in
    every episode at run time."""
    from mas_async.launch.cli import main

    text = EXAMPLE.read_text().replace("vertical: {policy: vertical}", "proposer: {policy: vertical}")
    path = tmp_path / "team.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"agents \['proposer'\] are not agents of env 'plan_path': its agents are "):
        load_config(path)
    assert main(["train", str(path), "--dry-run"]) == 2
    assert "vertical, horizontal" in capsys.readouterr().err
