"""`mas-async episodes CONFIG`: what a team does on held-out problems, turn by turn, for a results page.

It plays the first N problems of a split (the held-out ones as the run holds them out and `mas-async eval`
plays them, `mas_async.held_out`) in this one process: the config's workflow and nodes on its env, through
the framework's `Episode` in eval mode (one candidate per turn, greedy unless `eval.greedy=false`; each
problem's env reset with the seed its evaluation episode gets), with every request answered by the
policies' models loaded here (`mas_async.launch.local_policies`: the config's models, or a checkpoint as
`mas-async eval` takes one). Programs the models write run where the env runs them, in its sandbox.

The record of each episode (`play_episodes`, written by `--json`): the problem; each committed move in order
(turn, agent, policy, the completion as decoded, the action parsed or the parse error, its reward: alpha *
team reward + local reward) with what the env showed next after it (its observation to the agent that acts
next, e.g. the program's output that the reasoner reads); then the team reward, success, return and each
agent's reward as the evaluation logs them (the mean reward of its moves). `episode_lines` prints it, model
and env text as Python string literals (control characters escaped). No machine path is in either:
`without_machine_paths` writes a path inside the checkout relative to it, and any other absolute path under a
home, a temp folder or a workplace as "<machine path>/" and its last part (a traceback's file in the sandbox
is one).
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mas_async.api.registry import WORKFLOWS, resolve
from mas_async.launch.local_policies import LocalPolicies
from mas_async.launch.split_problems import first_problems
from mas_async.machine_paths import ROOT, shown_path

if TYPE_CHECKING:
    from mas_async.api.workflow import Candidate
    from mas_async.config import Config

_THIS_MACHINE = "|".join(re.escape(f"{folder}/") for folder in {ROOT, Path.home(), Path(tempfile.gettempdir())})
MACHINE_PATH = re.compile(
    r"(?<![\w.\-/~])(?:/(?:tmp|root|home|work|private|Users|var|mnt|scratch|data)/|~/|[A-Za-z]:\\|"
    + _THIS_MACHINE
    + r")[^\s'\"`:,;()<>\[\]{}]*"
)
"""An absolute path a machine has in some text: under a temp folder, a home, a workplace, a Windows drive, or
this machine's checkout, home or temp folder."""


def play_episodes(config: Config, count: int, split: str, policies: LocalPolicies | None = None) -> dict[str, Any]:
    """The record of `count` episodes on the first problems of `split` ("test": the held-out ones), played by
    `policies` (default: the config's, loaded once the config is found playable)."""
    from mas_async import sandbox
    from mas_async.rollout.nodes import build_nodes

    env_cls, problems, split_size = first_problems(config, count, split, "episodes")
    sandbox.configure(config.sandbox.unsafe_no_isolation, config.sandbox.cgroup_root)
    if env_cls.runs_code:
        sandbox.require_isolation()  # as an env worker: no silent fallback to running programs unconfined
    workflow = resolve(config.workflow.name, WORKFLOWS, "workflow")(build_nodes(config), **config.workflow.options)
    policies = LocalPolicies(config) if policies is None else policies

    async def play_all() -> list[dict[str, Any]]:  # one after another, on one event loop
        return [
            await _play(config, env_cls, workflow, policies, split, index, problem)
            for index, problem in enumerate(problems)
        ]

    episodes = asyncio.run(play_all())
    record = {
        "run": config.run.name,
        "split": split,
        "problems": split_size,
        "greedy": config.eval.greedy,
        "weights": dict(policies.sources),
        "version": policies.version,
        "episodes": episodes,
    }
    return without_machine_paths(record)


async def _play(
    config: Config, env_cls: Any, workflow: Any, policies: LocalPolicies, split: str, index: int, problem: dict
) -> dict[str, Any]:
    """One eval-mode episode of `problem`, the `index`-th of `split`, and its record."""
    from mas_async.rollout.episode import Episode, candidates_per_turn, greedy_decoding

    seed = index * 1000  # the seed of the problem's first evaluation episode (mas_async/router/episodes.py)
    env = env_cls()
    env.reset(seed=seed, options={"problem": copy.deepcopy(problem)})
    episode = Episode(
        episode_id=f"episodes-{split}{index}",
        problem_id=f"{split}{index}",
        env=env,
        policy_of=config.policy_of(),
        tokenizers=policies.tokenizers,
        generate=policies.generate,
        k=candidates_per_turn(config, "eval"),
        alpha=config.algorithm.alpha,
        mode="eval",
        seed=seed,
        greedy=greedy_decoding(config, "eval"),
        template_kwargs={p: spec.chat_template_kwargs for p, spec in config.policies.items()},
    )
    try:
        await workflow.run(episode)
        summary = episode.finish()
        committed = episode.committed
        moves = [_move(c, _next_agent(committed, i, env.possible_agents)) for i, c in enumerate(committed)]
        return {
            "index": index,
            "problem_id": f"{split}{index}",
            "seed": seed,
            "problem": _plain(problem),
            "moves": moves,
            "team_reward": float(episode.env.team_reward()),
            "success": bool(summary["success"]),
            "return": float(episode.episode_return),
            "rewards": {agent: summary[f"reward/{agent}"] for agent in config.agents if f"reward/{agent}" in summary},
            "turns": summary["turns"],
        }
    finally:
        env.close()  # as an env worker closes an episode's env


def _next_agent(committed: list[Candidate], index: int, agents: list[str]) -> str:
    """The agent that acts after move `index`: the next move's, else the next of the env's agents in order."""
    if index + 1 < len(committed):
        return committed[index + 1].agent
    agent = committed[index].agent
    return agents[(agents.index(agent) + 1) % len(agents)] if agent in agents else agent


def _move(candidate: Candidate, next_agent: str) -> dict[str, Any]:
    """One committed move: what the model wrote, what was parsed, its reward and what the env showed next."""
    observation = candidate.env.observe(next_agent)
    return {
        "turn": candidate.turn,
        "agent": candidate.agent,
        "policy": candidate.policy,
        "text": candidate.text,
        "action": _plain(candidate.action) if candidate.valid else None,
        "parse_error": candidate.error,
        "reward": candidate.reward,
        "team_reward": candidate.team_reward,
        "local_reward": candidate.local_reward,
        "next_agent": next_agent,
        "observation": observation if isinstance(observation, str) else _plain(observation),
    }


def _plain(value: Any) -> Any:
    """`value` as JSON holds it: itself when it is JSON (a dict, list, string, number), else its repr."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return repr(value)


def without_machine_paths(value: Any) -> Any:
    """`value` (strings in any nesting of dicts and lists) with every machine path in its strings written as
    a reader names it (`mas_async.machine_paths.shown_path`): relative to the repository when inside it, else
    "<machine path>/" and its last part."""
    if isinstance(value, dict):
        return {without_machine_paths(k): without_machine_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_machine_paths(item) for item in value]
    if isinstance(value, str):
        return MACHINE_PATH.sub(lambda match: shown_path(match.group(0), outside="<machine path>/"), value)
    return value


def episode_lines(record: dict[str, Any]) -> list[str]:
    """The record as a reader sees it: per episode the problem, every move, and the rewards at the end."""
    weights = ", ".join(f"{policy} {source}" for policy, source in record["weights"].items())
    decoding = "greedy" if record["greedy"] else "sampled"
    lines = [f"# {record['run']}: {len(record['episodes'])} of the run's {record['problems']} {record['split']} "
             f"problems, {decoding}; weights: {weights}"]  # fmt: skip
    for episode in record["episodes"]:
        lines.append(f"=== {record['split']} problem {episode['index']} (episode seed {episode['seed']})")
        lines.append(f"problem: {json.dumps(episode['problem'], ensure_ascii=True)}")
        for move in episode["moves"]:
            lines.append(f"--- turn {move['turn']}, {move['agent']} (policy {move['policy']})")
            lines.append(f"  wrote:  {move['text']!r}")
            if move["parse_error"] is None:
                lines.append(f"  action: {move['action']!r}")
            else:
                lines.append(f"  parse error: {move['parse_error']!r}")
            lines.append(f"  reward: {move['reward']:g} (team {move['team_reward']:g}, local {move['local_reward']:g})")
            lines.append(f"  env to {move['next_agent']}: {move['observation']!r}")
        rewards = ", ".join(f"{agent} {reward:g}" for agent, reward in episode["rewards"].items())
        lines.append(
            f"=== end: success {'yes' if episode['success'] else 'no'}, team reward {episode['team_reward']:g}, "
            f"return {episode['return']:g}, {episode['turns']} turns; rewards: {rewards}"
        )
    return lines
