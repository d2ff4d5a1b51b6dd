"""What a new user hit writing a team from the docs alone, each pinned: the run's sampling settings readable
from the task (so a program or framework asks exactly what the run trains on), and an env that runs code
stepped with `await env.astep` in a program, its blocking `step` refused with a sentence that says so."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from mas_async.api.env import Env
from mas_async.gateway.episode import StepBlocks
from mas_async.gateway.sampling import RunSampling
from mas_async.tiny_model import build_tokenizer
from tests.unit.gateway import fakes
from tests.unit.gateway.fakes import LIMITS, FakeInference, play_program


def _seen(mode: str, limits: Any = LIMITS) -> tuple[RunSampling, FakeInference]:
    seen: list[RunSampling] = []

    async def program(task: Any, agents: dict[str, Any]) -> None:
        seen.append(task.sampling)
        settings = {"temperature": task.sampling.temperature, "max_tokens": task.sampling.max_tokens}
        await agents["vertical"].chat.completions.create(
            model="vertical", messages=[{"role": "user", "content": "GO"}], n=task.sampling.k, **settings
        )

    fake = FakeInference(build_tokenizer())
    play_program(program, fake, limits=limits, mode=mode)
    return seen[0], fake


def test_a_program_reads_the_runs_sampling_settings_from_its_task() -> None:
    train, fake = _seen("train")
    assert train == RunSampling(temperature=LIMITS.temperature, max_tokens=LIMITS.max_tokens, k=LIMITS.max_n)
    assert fake.requests[0]["n"] == LIMITS.max_n and fake.requests[0]["greedy"] is False  # asked as is: accepted
    evaluation, fake = _seen("eval")
    assert evaluation.temperature == 0.0 and fake.requests[0]["greedy"] is True  # eval.greedy
    sampled, fake = _seen("eval", dataclasses.replace(LIMITS, eval_greedy=False))
    assert sampled.temperature == LIMITS.temperature and fake.requests[0]["greedy"] is False


class CodeEnv(Env):
    """A toy env that "runs code": `astep` is the real step; the synchronous `step` would block."""

    possible_agents = ["vertical", "horizontal"]
    runs_code = True

    def __init__(self) -> None:
        self.moves: list[str] = []
        self.terminations = dict.fromkeys(self.possible_agents, False)
        self.truncations = dict.fromkeys(self.possible_agents, False)
        self.infos: dict[str, dict[str, Any]] = {a: {} for a in self.possible_agents}

    def observe(self, agent: str) -> str:
        return "GO"

    def step(self, agent: str, action: Any) -> None:
        self.moves.append(f"sync {action}")

    async def astep(self, agent: str, action: Any) -> None:
        self.moves.append(f"async {action}")

    def team_reward(self) -> float:
        return float(len(self.moves))


def test_a_program_steps_an_env_that_runs_code_with_astep_and_its_step_is_refused(monkeypatch: Any) -> None:
    monkeypatch.setattr(fakes, "plan_path_env", CodeEnv)

    async def awaits(task: Any, agents: dict[str, Any]) -> None:
        await task.env.astep("vertical", "U")

    episode = play_program(awaits, FakeInference(build_tokenizer()), limits=LIMITS)
    assert episode.env.moves == ["async U"] and episode.rewards.team == 1.0

    async def blocks(task: Any, agents: dict[str, Any]) -> None:
        task.env.clone().step("vertical", "U")

    with pytest.raises(StepBlocks, match=r"CodeEnv runs code: .* use `await env.astep\(agent, action\)`"):
        play_program(blocks, FakeInference(build_tokenizer()), limits=LIMITS)
    assert CodeEnv().step("vertical", "U") is None  # (the class itself is untouched)
