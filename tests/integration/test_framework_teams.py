"""Teams written with real agent frameworks train end to end through `mas-async train`, every role a real
process: the OpenAI Agents SDK's movers (nodes/examples/agents_sdk_movers.py, on the SDK's default model,
the Responses API) with their calls in-process and over HTTP, pydantic-ai's movers (the Responses API,
in-process), and the LangGraph + langchain-openai movers
(nodes/examples/langgraph_movers.py, chat completions, over HTTP). Each trains 2 iterations strictly
on-policy with every call after an agent's first reusing its history's exact ids, none edited.

Skipped when the frameworks are not installed (`make install` installs them: the `frameworks` extra).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.integration.launch import cleanup, start_train

FAST = ["run.iterations=2", "rollout.batch_size=2", "algorithm.k=2", "eval.every=2", "eval.size=2"]


def _needs(*packages: str) -> pytest.MarkDecorator:
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (make install: the frameworks extra)")


def _train(config: str, run_dir: Path, *overrides: str) -> list[dict]:
    proc = start_train(config, run_dir, *FAST, *overrides)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_on_policy(rows: list[dict], in_process: bool) -> None:
    train = [r for r in rows if "policy/vertical/version" in r]
    assert len(train) == 2, rows
    for i, row in enumerate(train):
        assert row["rollout/dropped"] == 0 and row["rollout/episodes"] == 4, row  # 2 problems x K=2 episodes
        for agent in ("vertical", "horizontal"):  # one policy per agent, of the same name
            assert row[f"policy/{agent}/version"] == i
            assert row[f"policy/{agent}/version_mismatch"] == 0
            assert row[f"policy/{agent}/samples"] > 0
            assert row[f"policy/{agent}/logprob_abs_diff"] < 1e-4
            calls = row[f"gateway/calls/{agent}"]
            assert calls >= 1 and row[f"gateway/prefix_mismatch/{agent}"] == 0, row
            assert row[f"gateway/in_process/{agent}"] == (calls if in_process else 0), row
            kept = row[f"gateway/reused/{agent}"] + row[f"gateway/retokenized/{agent}"]
            assert abs(kept - (calls - 1)) < 1e-9, row
            # every one reused: replies that ended on <|endoftext|> (the template closes turns with <|im_end|>)
            # or held special tokens included
            assert row[f"gateway/retokenized/{agent}"] == 0, row
    evaluated = [r for r in rows if "eval/episodes" in r]
    assert evaluated and all(r["eval/episodes"] == 2 and r["eval/dropped"] == 0 for r in evaluated), rows


@_needs("agents")
@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "over-http"])
def test_the_agents_sdk_team_trains_on_policy_over_the_responses_api(tmp_path: Path, in_process: bool) -> None:
    rows = _train(
        "configs/examples/agents_sdk_movers.yaml",
        tmp_path / "run",
        "workflow.options.max_turns=3",
        f"gateway.in_process={in_process}",
    )
    _check_on_policy(rows, in_process)


@_needs("pydantic_ai")
def test_the_pydantic_ai_team_trains_on_policy_over_the_responses_api(tmp_path: Path) -> None:
    rows = _train("configs/examples/pydantic_ai_movers.yaml", tmp_path / "run", "workflow.options.max_turns=3")
    _check_on_policy(rows, in_process=True)


@_needs("langgraph", "langchain_openai")
def test_the_langgraph_team_trains_on_policy_over_chat_completions(tmp_path: Path) -> None:
    rows = _train("configs/examples/langgraph_movers.yaml", tmp_path / "run", "workflow.options.max_turns=3")
    _check_on_policy(rows, in_process=False)  # ChatOpenAI asks for raw responses: over HTTP
