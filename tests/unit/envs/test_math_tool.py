"""The math tool team (envs/math_tool.py, nodes/math_tool.py): the replies read as programs and answers,
a team episode's order and rewards (the program run in the sandbox), the single agent's two steps, the
reference policies (a constant answer scores 0, the reference tool is always right), check_env on both
envs over the arithmetic problems, and the three configs' shared budget."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from envs.check import check_env
from envs.math_tool import MathToolEnv, MathToolSoloEnv
from mas_async.api import ParseError, run_sync
from mas_async.config import load_config
from mas_async.rollout.episode import Episode
from nodes.math_tool import (
    AnswerReader,
    MathToolSoloWorkflow,
    MathToolWorkflow,
    SoloToolAgent,
    ToolWriter,
    read_answer,
    read_program,
)
from tests.support.chat_fakes import ScriptedGenerate
from tests.support.paths import ROOT

PROBLEM = {"id": "t/0", "problem": "What is 964 * 59?", "answer": "56876", "expression": "964 * 59"}


class Tokenizer:
    """Every character a token; the prompt ends where the reply starts (a given start included)."""

    def apply_chat_template(self, messages: list[dict], tokenize: bool, **options: Any) -> list[int]:
        return [ord(ch) for m in messages for ch in f"<{m['role']}>{m['content']}"]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)


def episode(env: Any, agents: tuple[str, ...], generate: ScriptedGenerate, k: int) -> Episode:
    return Episode(
        episode_id="e0",
        problem_id="p0",
        env=env,
        policy_of={agent: agent for agent in agents},
        tokenizers={agent: Tokenizer() for agent in agents},
        generate=generate,
        k=k,
        alpha=1.0,
    )


def test_programs_and_answers_are_read_from_the_continued_reply() -> None:
    assert read_program("964 * 59)\n```\nIt prints the product.", "t") == "print(964 * 59)\n"
    assert read_program("3)\nprint(4)", "t") == "print(3)\nprint(4)"  # the fence never closed: all of it
    for bad in ("```", "  \n```", "964 *\n```", "964 * 59\n```"):
        with pytest.raises(ParseError):
            read_program(bad, "t")
    assert read_answer("56876}. Done.", "r")["answer"] == "56876"
    assert read_answer("\\frac{1}{2}} is it", "r")["answer"] == "\\frac{1}{2}"
    for bad in ("56876", "}", "\\frac{1}{2"):
        with pytest.raises(ParseError):
            read_answer(bad, "r")


def test_team_episode_runs_the_program_then_the_reasoner_answers() -> None:
    env = MathToolEnv()
    env.reset(options={"problem": PROBLEM})
    generate = ScriptedGenerate(
        {
            "tool_user": [["964 * 59)\n```", "964 + 59)\n```"]],
            "reasoner": [["56876} is the answer", "no brace"]],
        }
    )
    run = episode(env, ("tool_user", "reasoner"), generate, k=2)
    nodes = {"tool_user": ToolWriter(), "reasoner": AnswerReader()}
    asyncio.run(MathToolWorkflow(nodes, max_turns=2).run(run))
    assert generate.calls == [("tool_user", 2), ("reasoner", 2)]  # they agreed in turn 0: the end
    rewards = [(s.agent, s.turn, s.reward) for s in run.samples]
    # The right program: team (its answer stands for the team's) + its own; the wrong one 0; the
    # reasoner's right answer 2; its unparsable reply the penalty.
    assert rewards == [("tool_user", 0, 2.0), ("tool_user", 0, 0.0), ("reasoner", 0, 2.0), ("reasoner", 0, -1.0)]
    assert run.env.tool_output.strip() == "56876" and run.env.done and run.finish()["success"] is True
    # The reasoner was shown the program and what it printed, and its reply was opened for it.
    messages = AnswerReader().prompt(run.env.observe("reasoner"))
    assert "print(964 * 59)" in messages[1]["content"] and "56876" in messages[1]["content"]
    assert messages[-1] == {"role": "assistant", "content": "\\boxed{"}


def test_solo_agent_writes_then_answers_then_writes_again() -> None:
    env = MathToolSoloEnv()
    env.reset(options={"problem": PROBLEM})
    # A wrong program, an answer that differs from its output, a program that agrees with it: the end.
    generate = ScriptedGenerate({"solo": [["964 + 59)\n```"], ["56876}"], ["964 * 59)\n```"]]})
    run = episode(env, ("solo",), generate, k=1)
    asyncio.run(MathToolSoloWorkflow({"solo": SoloToolAgent()}, max_turns=4).run(run))
    assert generate.calls == [("solo", 1)] * 3
    assert [(s.turn, s.reward) for s in run.samples] == [(0, 0.0), (1, 2.0), (2, 2.0)]
    assert run.env.done and run.finish()["success"] is True
    with pytest.raises(TypeError, match="SoloToolAgent"):
        asyncio.run(MathToolSoloWorkflow({"solo": ToolWriter("solo")}).run(run))


def test_solo_env_refuses_the_step_not_due() -> None:
    env = MathToolSoloEnv()
    env.reset(options={"problem": PROBLEM})
    with pytest.raises(TypeError):
        env.step("solo", {"answer": "56876", "reasoning": ""})
    env.step("solo", {"code": "print(964 * 59)"})
    assert env.expects() == "answer" and "ITS OUTPUT:\n56876" in env.observe("solo")
    with pytest.raises(TypeError):
        env.step("solo", {"code": "print(1)"})


def play(env: Any, policy: Any, agents: list[str]) -> float:
    rng = random.Random(0)
    for agent in agents:
        run_sync(lambda agent=agent: env.astep(agent, policy(env, agent, rng)))
    return env.team_reward()


@pytest.mark.parametrize("env_cls", [MathToolEnv, MathToolSoloEnv])
def test_reference_tool_is_right_and_the_constant_is_wrong(env_cls: type) -> None:
    policies = env_cls.reference_policies()
    agents = ["tool_user", "reasoner"] if env_cls is MathToolEnv else ["solo", "solo"]
    for problem in env_cls.problems("test", 6, dataset="arithmetic"):
        for name, expected in (("reference_tool", 1.0), ("always_0", 0.0)):
            env = env_cls()
            env.reset(options={"problem": problem})
            assert play(env, policies[name], agents) == expected, (name, problem)
            assert env.done  # the program's answer and the final one agree: one round
    env = env_cls()
    env.reset(options={"problem": {"problem": "1 + 1?", "answer": "2"}})
    with pytest.raises(ValueError, match="expression"):
        policies["reference_tool"](env, agents[0], random.Random(0))


@pytest.mark.parametrize("env_cls", [MathToolEnv, MathToolSoloEnv])
def test_check_env_passes_on_arithmetic_problems(env_cls: type) -> None:
    report = check_env(env_cls, count=2, steps=4, dataset="arithmetic")
    assert "stepping" in report.checked and not report.skipped, report


def test_configs_share_the_budget_and_normalise_per_agent() -> None:
    names = ("math_tool_smollm2", "math_tool_smollm2_shared", "math_tool_smollm2_single")
    team, shared, single = (load_config(ROOT / "configs" / f"{name}.yaml") for name in names)
    assert len(team.policies) == 2 and len(shared.policies) == 1 and list(single.agents) == ["solo"]
    for config in (team, shared, single):
        assert config.algorithm.k == team.algorithm.k and config.run.iterations == team.run.iterations
        assert config.rollout.batch_size == team.rollout.batch_size
        assert config.env.options == team.env.options and config.env.test_size == team.env.test_size
        assert config.eval.size == team.eval.size == config.env.test_size
        assert config.algorithm.grouping == "agent_turn" and config.algorithm.std_scope == "agent"
    # A team turn is two steps (program, answer); the single agent gets as many steps.
    assert single.workflow.options["max_turns"] == 2 * team.workflow.options["max_turns"]
    assert shared.workflow == team.workflow
