"""The episode of a workflow program: its session, its program run, and the samples its calls become.

`GatewayEpisode` stands where `rollout.episode.Episode` stands for a workflow class: the env worker
builds one per RunEpisode, the workflow plays it (`play`: open a session, give the program its task and
one `openai.AsyncOpenAI` client per agent, await it, close the session), and `samples` / `finish()` are
read the same way. In training every returned choice becomes one `Sample` of its agent's turn, credited
with the program's rewards:

    reward(agent a) = alpha * team + local[a]

where the program returns None (team = the env's `team_reward()`, no local rewards), a number (the team
reward), or a dict with "team" (else the env's), "local" ({agent: reward}) and "success" (else the env's
`success()`). Samples are grouped by (problem, agent, turn), key "<problem_id>/<agent>/<turn>": under
parallel sampling the K episodes of a problem are its K draws, so agent a's t-th calls across them form
one group and GRPO's advantages compare like with like (a group of one gets advantage 0). The episode's
return, for `grouping: trajectory`, is alpha * team + the sum of the local rewards.

Under tree sampling (`tree.py`) a training call is K candidates of one state, and each is credited as the
node classes credit theirs: with its own score, the scorer's (which, like a node class's score on its env
clone, may include a team term), in the group "<episode_id>/<agent>/<turn>" of K samples of this episode
(its K draws are its candidates: a problem run twice in an iteration keeps two groups). The episode's
rewards, constant over the K candidates of a call, would cancel in every agent_turn advantage, so they are
not added; they still give the episode's return, success and reward/<agent>. A scorer's failure fails the
episode (`ScoreError`), whatever the program did with its call's error.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mas_async.gateway.loading import Program
from mas_async.gateway.transcript import SOURCES
from mas_async.gateway.tree import ScoreError
from mas_async.metrics import REFUSED_AUTH
from mas_async.wire.samples import Sample

if TYPE_CHECKING:
    from mas_async.api.env import Env
    from mas_async.gateway.sampling import RunSampling
    from mas_async.gateway.server import Gateway
    from mas_async.gateway.session import Session


class StepBlocks(RuntimeError):
    """A workflow program called the synchronous `step` of an env that runs code (module of `Task.env`)."""


class _AsyncStepOnly:
    """The `step` of a code-running env inside a workflow program's episode: a refusal that says to await
    `astep`. (Its synchronous `step` runs the sandbox on a helper thread while the calling thread, the env
    worker's event loop, waits: every episode of the worker would stop meanwhile.) Set on the episode's own
    env instance, so its clones (copies of the instance) refuse too; the env class is untouched."""

    def __init__(self, env_name: str) -> None:
        self.env_name = env_name

    def __call__(self, agent: str, action: Any) -> None:
        raise StepBlocks(
            f"{self.env_name} runs code: its synchronous step would block the env worker's event loop, and every "
            "episode on it, while the sandbox runs; in a workflow program use `await env.astep(agent, action)`"
        )


class RewardError(ValueError):
    """A workflow program returned rewards the episode cannot read (the message says what it expects)."""


@dataclass(slots=True)
class Task:
    """What a workflow program is given about its episode."""

    env: Env
    """The episode's env, reset to the problem: the program may `observe` and `step` it; an env that runs code
    (`runs_code`: the code, math and tool envs) is stepped with `await env.astep(agent, action)`, and its
    `step` refuses (`StepBlocks`): it would stop every episode on the worker while the sandbox runs."""
    problem: dict[str, Any]
    """The problem (one entry of the env's dataset)."""
    observation: dict[str, Any]
    """agent -> `env.observe(agent)` at the start of the episode."""
    agents: tuple[str, ...]
    """The agents of the run: the `model` names the program's clients may call."""
    episode_id: str
    mode: str
    """"train" (every call becomes a sample) or "eval" (nothing is recorded)."""
    base_url: str = ""
    """The gateway's base URL (http://host:port/v1) that the episode's clients call."""
    api_key: str = ""
    """The episode's API key (its session key; after the run's token on an external gateway). With `base_url`
    it is all that an agent service outside the run needs to make the episode's calls itself."""
    sampling: RunSampling | None = None
    """The run's sampling settings for this episode (temperature, max_tokens, k, top_p: `RunSampling`), so a
    program or framework can be given exactly what the run trains on (a call may also leave them out)."""


@dataclass(slots=True)
class Rewards:
    team: float
    local: dict[str, float]
    success: bool


class GatewayEpisode:
    """One episode of a workflow program (module docstring)."""

    def __init__(
        self,
        *,
        gateway: Gateway,
        episode_id: str,
        problem_id: str,
        problem: dict[str, Any],
        env: Env,
        policy_of: dict[str, str],
        alpha: float,
        mode: str,
        client_timeout_s: float,
    ) -> None:
        self.gateway = gateway
        self.episode_id = episode_id
        self.problem_id = problem_id
        self.problem = problem
        self.env = env
        self.policy_of = dict(policy_of)
        self.alpha = float(alpha)
        self.mode = mode
        self.client_timeout_s = client_timeout_s
        self.samples: list[Sample] = []
        self.session: Session | None = None
        self.rewards: Rewards | None = None

    async def play(self, program: Program, options: dict[str, Any]) -> None:
        """Run the program with one client per agent on a new session; credit its calls with its rewards."""
        from openai import AsyncOpenAI  # imported by episodes of a program only

        from mas_async.gateway.in_process import InProcessClient

        agents = tuple(self.policy_of)
        session = self.gateway.open(episode_id=self.episode_id, problem_id=self.problem_id, mode=self.mode)
        self.session = session
        if getattr(self.env, "runs_code", False) and getattr(self.env, "astep", None) is not None:
            self.env.step = _AsyncStepOnly(type(self.env).__name__)  # type: ignore[method-assign]
        try:  # (whatever fails from here, the env's observe included, the session is closed: its key stops working)
            # No retries (a retried call would be a second sample); the gateway's connection pool, which the
            # clients of every episode share (closing a client would close it: they are left to the collector).
            api_key = self.gateway.api_key(session)
            tree = self.gateway.limits.tree if self.mode == "train" else None
            # A tree-sampled call also awaits the scoring of its K candidates, each within tree.timeout_s.
            timeout = self.client_timeout_s + (tree.timeout_s if tree is not None else 0.0)
            # In-process clients hand their plain calls to the gateway without HTTP (`in_process.py`).
            client_class = InProcessClient if self.gateway.in_process else AsyncOpenAI
            clients = {
                agent: client_class(
                    base_url=self.gateway.base_url,
                    api_key=api_key,
                    max_retries=0,
                    timeout=timeout,
                    http_client=self.gateway.clients_http,
                )
                for agent in agents
            }
            for client in clients.values():
                if isinstance(client, InProcessClient):
                    client.bind(self.gateway)
            task = Task(
                env=self.env,
                problem=self.problem,
                observation={agent: self.env.observe(agent) for agent in agents},
                agents=agents,
                episode_id=self.episode_id,
                mode=self.mode,
                base_url=self.gateway.base_url,
                api_key=api_key,
                sampling=self.gateway.limits.settings(self.mode),
            )
            if tree is not None:
                scorer = self.gateway.scorer
                assert scorer is not None, "a gateway with tree sampling loads its scorer"
                session.score = functools.partial(scorer, task)
            result = await program(task, clients, **options)
        except Exception:
            if session.failure is not None:  # the program saw the scorer's failure as its call's error
                raise ScoreError(session.failure) from None
            raise
        finally:
            self.gateway.close(session)
        if session.failure is not None:  # (a program that caught its call's error and went on)
            raise ScoreError(session.failure)
        self.rewards = read_rewards(result, self.env, agents)
        if self.mode == "train":
            self.samples = self._samples(session, self.rewards)

    def _samples(self, session: Session, rewards: Rewards) -> list[Sample]:
        episode_return = self.alpha * rewards.team + sum(rewards.local.values())
        samples = []
        for call in session.calls:
            if call.score is None:  # parallel sampling: credited with the episode's rewards
                group = f"{self.problem_id}/{call.agent}/{call.turn}"
                reward = self.alpha * rewards.team + rewards.local.get(call.agent, 0.0)
                info = {"index": call.index, "prompt_source": call.prompt_source}
            else:  # a tree-sampled call's candidate: its own score, in the group of its episode's state
                group, reward = f"{self.episode_id}/{call.agent}/{call.turn}", call.score
                info = {"index": call.index, "prompt_source": call.prompt_source, "chosen": call.chosen}
            samples.append(
                Sample(
                    group=group,
                    episode_id=self.episode_id,
                    problem_id=self.problem_id,
                    agent=call.agent,
                    policy=call.policy,
                    turn=call.turn,
                    prompt_ids=np.asarray(call.prompt_ids, dtype=np.int32),
                    completion_ids=np.asarray(call.completion.token_ids, dtype=np.int32),
                    logprobs=np.asarray(call.completion.logprobs, dtype=np.float32),
                    version=call.completion.version,
                    reward=reward,
                    episode_return=episode_return,
                    info=info,
                )
            )
        return samples

    def finish(self) -> dict[str, Any]:
        """The episode's metrics: success, reward/<agent>, turns, tokens, and the gateway's counts per agent
        (calls, those answered in-process, and the prompt sources: reused, prefix_mismatch (an edited
        history), retokenized; under tree sampling the mean score of its candidates, gateway/score/<agent>)."""
        session, rewards = self.session, self.rewards
        assert session is not None and rewards is not None, "finish() before play()"
        tokens = sum(len(c.completion.token_ids) for c in session.calls)
        versions = {c.completion.version for c in session.calls}
        summary: dict[str, Any] = {
            "success": rewards.success,
            "turns": max(session.turns.values(), default=0),
            "tokens": tokens,
            "multi_version_tokens": tokens if len(versions) > 1 else 0,
        }
        if self.gateway.access.external:  # the worker's refusals since its previous episode, summed by the router
            summary[REFUSED_AUTH] = self.gateway.access.take_refused()
        scores: dict[str, list[float]] = {}
        for call in session.calls:
            if call.score is not None:
                scores.setdefault(call.agent, []).append(call.score)
        for agent in self.policy_of:
            summary[f"reward/{agent}"] = self.alpha * rewards.team + rewards.local.get(agent, 0.0)
            summary[f"gateway/calls/{agent}"] = session.turns[agent]
            summary[f"gateway/in_process/{agent}"] = session.in_process[agent]
            if agent in scores:  # tree sampling: the mean score of the agent's candidates
                summary[f"gateway/score/{agent}"] = float(np.mean(scores[agent]))
            for source in SOURCES:  # (fresh: the history held none of its replies; its first call is one)
                name = "prefix_mismatch" if source == "edited" else source
                summary[f"gateway/{name}/{agent}"] = session.sources[(agent, source)]
        return summary


def read_rewards(result: Any, env: Env, agents: tuple[str, ...]) -> Rewards:
    """The rewards a program returned: None, a number (team reward) or {"team", "local", "success"}."""
    if result is None:
        return Rewards(_finite(env.team_reward(), "env.team_reward()"), {}, bool(env.success()))
    if isinstance(result, (int, float)) and not isinstance(result, bool):
        return Rewards(_finite(result, "the returned team reward"), {}, bool(env.success()))
    if not isinstance(result, dict):
        raise RewardError(
            f"a workflow program returns None, a team reward or a dict with team/local/success, got {type(result).__name__}"
        )
    unknown = sorted(set(result) - {"team", "local", "success"})
    if unknown:
        raise RewardError(f"the returned rewards have unknown key(s) {unknown}: expected team, local, success")
    team = result.get("team")
    team = env.team_reward() if team is None else team
    local = result.get("local") or {}
    if not isinstance(local, dict) or any(agent not in agents for agent in local):
        raise RewardError(
            f"rewards['local'] must map agents of the run ({', '.join(agents)}) to numbers, got {local!r}"
        )
    success = result.get("success")
    return Rewards(
        _finite(team, "rewards['team']"),
        {agent: _finite(value, f"rewards['local'][{agent!r}]") for agent, value in local.items()},
        bool(env.success() if success is None else success),
    )


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardError(f"{what} must be a finite number, got {value!r}")
    return float(value)
