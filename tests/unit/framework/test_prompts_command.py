"""`mas-async prompts CONFIG`: each agent's prompt of the first problems, as its policy's chat template renders
it (the env worker's own tokenisation), with its token count; the held-out problems as the run holds them out."""

from __future__ import annotations

import re

from mas_async.config import load_config
from mas_async.launch.cli import main
from mas_async.launch.prompts import prompt_lines
from tests.support.paths import ROOT


def test_it_prints_each_agents_prompt_with_its_token_count(capsys) -> None:
    assert main(["prompts", str(ROOT / "configs/plan_path_tiny.yaml"), "--n", "2", "--split", "test"]) == 0
    out = capsys.readouterr().out
    titles = re.findall(r"=== test problem (\d) \(seed (\d+)\), agent (\w+), policy \w+: (\d+) tokens", out)
    assert [(t[0], t[2]) for t in titles] == [
        ("0", "vertical"),
        ("0", "horizontal"),
        ("1", "vertical"),
        ("1", "horizontal"),
    ]
    assert all(int(t[1]) >= 10**9 for t in titles)  # test seeds
    assert "A=" in out and "G=" in out  # the observation (the tiny model's prompt is the bare observation)
    assert out.rstrip().endswith("=== 2 of the run's 64 test problems, 2 agents each")


def test_the_count_is_the_env_workers_tokenisation(capsys) -> None:
    from transformers import AutoTokenizer

    from envs.plan_path import PlanPathEnv
    from mas_async.launch.launcher import model_cache_dir
    from mas_async.model_source import resolve_model
    from mas_async.rollout.chat_prompt import chat_prompt_ids
    from nodes.plan_path import VerticalMover

    config = load_config(ROOT / "configs/plan_path_tiny.yaml")
    lines = prompt_lines(config, 1, "train")
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("builtin:tiny-char", model_cache_dir())))
    env = PlanPathEnv()
    problem = PlanPathEnv.problems("train", 1, sizes=[4, 5])[0]
    env.reset(options={"problem": problem})
    ids = chat_prompt_ids(tokenizer, VerticalMover().prompt(env.observe("vertical")))
    assert lines[0].endswith(f"agent vertical, policy vertical: {len(ids)} tokens")
    assert lines[1] == tokenizer.decode(ids)


def test_a_workflow_program_is_refused_with_a_sentence(capsys) -> None:
    assert main(["prompts", str(ROOT / "configs/examples/openai_movers.yaml")]) == 2
    assert "writes its own prompts" in capsys.readouterr().err
