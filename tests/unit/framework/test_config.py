"""Config loading: defaults, dotted overrides, and errors that name the key and the file."""

from __future__ import annotations

import pytest

from mas_async.config import ConfigError, dump_config, load_config
from tests.support.paths import ROOT

CONFIGS = ROOT / "configs"


def test_shipped_configs_load():
    for path in sorted(CONFIGS.glob("*.yaml")):
        config = load_config(path)
        assert set(config.policy_of().values()) == set(config.policies)


def test_overrides_set_nested_values_with_yaml_types():
    config = load_config(
        CONFIGS / "plan_path_tiny.yaml",
        ["rollout.batch_size=8", "policies.vertical.lr=3e-4", "env.options.sizes=[4]", "eval.greedy=false"],
    )
    assert config.rollout.batch_size == 8
    assert config.policies["vertical"].lr == pytest.approx(3e-4)
    assert config.env.options["sizes"] == [4]
    assert config.eval.greedy is False


def test_unknown_key_names_the_key_and_the_file():
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "plan_path_tiny.yaml", ["rollout.batchsize=8"])
    assert "rollout.batchsize" in str(e.value) and "plan_path_tiny.yaml" in str(e.value)


def test_mistyped_value_names_key_and_value(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "plan_path_tiny.yaml", ["algorithm.k=many"])
    assert "algorithm.k" in str(e.value) and "many" in str(e.value)


def test_bad_choice_is_an_error():
    with pytest.raises(ConfigError, match="algorithm.grouping"):
        load_config(CONFIGS / "plan_path_tiny.yaml", ["algorithm.grouping=episode"])


def test_agent_naming_an_unknown_policy_is_an_error():
    with pytest.raises(ConfigError, match="agents.vertical.policy"):
        load_config(CONFIGS / "plan_path_tiny.yaml", ["agents.vertical.policy=nobody"])


def test_missing_file_and_bad_override_syntax(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(CONFIGS / "plan_path_tiny.yaml", ["rollout.batch_size"])


def test_invalid_yaml_is_reported(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_resolved_config_round_trips(tmp_path):
    config = load_config(CONFIGS / "plan_path_tiny.yaml", ["run.iterations=3"])
    dump_config(config, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == config
    assert "micro_batch_sequences" in (tmp_path / "config.yaml").read_text()  # defaults are written out


def test_fields_are_documented():
    from mas_async.config import RolloutConfig

    assert "Problems" in (RolloutConfig.model_fields["batch_size"].description or "")


def test_shipped_configs_load_including_examples():
    # Every shipped config passes the validator (the learnability checks included), examples too.
    paths = sorted(CONFIGS.glob("**/*.yaml"))
    assert len(paths) > 20 and any(p.parent.name == "examples" for p in paths)
    for path in paths:
        load_config(path)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        # Tree sampling runs one episode per problem: trajectory advantages compare it with itself.
        (["algorithm.grouping=trajectory"], ["algorithm.sampling=tree", "algorithm.grouping=trajectory"]),
        # One candidate per turn (tree) or one episode per problem (parallel): groups of one.
        (["algorithm.k=1"], ["algorithm.k=1", "algorithm.sampling=tree", "every advantage is 0"]),
        (
            ["algorithm.k=1", "algorithm.sampling=parallel", "algorithm.grouping=agent"],
            ["algorithm.k=1", "algorithm.sampling=parallel", "one episode per problem"],
        ),
        (
            ["algorithm.k=1", "algorithm.sampling=parallel", "algorithm.grouping=trajectory"],
            ["algorithm.k=1", "algorithm.sampling=parallel"],
        ),
        # Per-agent pooling under tree sampling mixes the turns' baselines: the sentence names the fix.
        (
            ["algorithm.grouping=agent"],
            [
                "algorithm.grouping=agent",
                "algorithm.sampling=tree",
                "algorithm.grouping=agent_turn with algorithm.std_scope=agent",
            ],
        ),  # fmt: skip
        (
            ["algorithm.sampling=parallel", "algorithm.grouping=agent", "algorithm.std_scope=agent"],
            ["algorithm.std_scope=agent", "algorithm.grouping=agent"],
        ),  # fmt: skip
        (
            ["algorithm.std_scope=agent", "algorithm.normalize_std=false"],
            ["algorithm.std_scope=agent", "algorithm.normalize_std=false"],
        ),  # fmt: skip
        # The log-probs ignore the nucleus cut, and evaluation shares rollout.top_p.
        (["rollout.top_p=0.9"], ["rollout.top_p=0.9", "nucleus", "evaluation", "rollout.top_p=1.0"]),
    ],
)
def test_configs_that_cannot_learn_are_refused_with_a_sentence(overrides, named):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "plan_path_tiny.yaml", overrides)
    for part in named:
        assert part in str(e.value)


def test_learnable_algorithm_compositions_are_accepted():
    for overrides in (
        [],  # AT-GRPO
        ["algorithm.std_scope=agent"],  # AT-GRPO groups with Dr. MAS's per-agent std
        ["algorithm.sampling=parallel", "algorithm.grouping=agent"],  # Dr. MAS as published
        ["algorithm.sampling=parallel", "algorithm.grouping=trajectory", "algorithm.k=2"],  # vanilla GRPO
        ["algorithm.normalize_std=false"],
        ["rollout.top_p=1.0"],
    ):
        load_config(CONFIGS / "plan_path_tiny.yaml", overrides)
    routed = load_config(CONFIGS / "math_routed_tiny.yaml")
    assert (routed.algorithm.sampling, routed.algorithm.grouping, routed.algorithm.std_scope) == (
        "tree",
        "agent_turn",
        "agent",
    )
