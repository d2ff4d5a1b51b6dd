"""`mas-async prompts CONFIG`: the prompts of a run exactly as its models read them, with their lengths.

For the first N problems of a split (the held-out ones as the run holds them out, `mas_async.held_out`),
each agent's prompt in the problem's first state: its node's messages under its policy's chat template
(`mas_async.rollout.chat_prompt`, the env worker's own tokenisation), the text the model reads and its
token count. What anyone writing a node's prompt should look at before training on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mas_async.launch.split_problems import first_problems
from mas_async.rollout.chat_prompt import chat_prompt_ids, chat_prompt_text
from mas_async.rollout.nodes import build_nodes

if TYPE_CHECKING:
    from mas_async.config import Config


def prompt_lines(config: Config, count: int, split: str) -> list[str]:
    """The printed prompts of the first `count` problems of `split` ("train" or "test")."""
    from transformers import AutoTokenizer

    from mas_async.launch.launcher import model_cache_dir
    from mas_async.model_source import resolve_model

    env_cls, problems, env_count = first_problems(config, count, split, "prompts")
    nodes = build_nodes(config)
    tokenizers = {
        policy: AutoTokenizer.from_pretrained(
            str(resolve_model(spec.model, model_cache_dir(), spec.revision, policy=policy))
        )
        for policy, spec in config.policies.items()
    }
    lines: list[str] = []
    for index, problem in enumerate(problems):
        env = env_cls()
        env.reset(seed=problem.get("seed"), options={"problem": problem})
        for agent, node in nodes.items():
            policy = config.agents[agent].policy
            messages = node.prompt(env.observe(agent))
            kwargs = config.policies[policy].chat_template_kwargs
            tokens = len(chat_prompt_ids(tokenizers[policy], messages, kwargs))
            title = f"{split} problem {index} (seed {problem.get('seed', '-')}), agent {agent}, policy {policy}"
            lines += [f"=== {title}: {tokens} tokens", chat_prompt_text(tokenizers[policy], messages, kwargs)]
    lines.append(f"=== {len(problems)} of the run's {env_count} {split} problems, {len(nodes)} agents each")
    return lines
