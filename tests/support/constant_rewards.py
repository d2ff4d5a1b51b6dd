"""Plan-Path whose every reward is 0 (no team reward, no local reward, and every reply read as a move, so no
invalid-action penalty either): every advantage is 0, so a run trains nothing. `env.name: tests.support.constant_rewards:ZeroRewardPlanPath`, the agents' nodes
`tests.support.constant_rewards:ZeroVertical` and `ZeroHorizontal`."""

from __future__ import annotations

from typing import Any

from envs.plan_path import PlanPathEnv
from nodes.plan_path import HorizontalMover, VerticalMover


class ZeroRewardPlanPath(PlanPathEnv):
    def team_reward(self) -> float:
        return 0.0


class ZeroVertical(VerticalMover):
    def parse(self, text: str) -> str:
        return self.moves[0]

    def local_reward(self, before: PlanPathEnv, action: Any, after: PlanPathEnv) -> float:
        return 0.0


class ZeroHorizontal(HorizontalMover):
    def parse(self, text: str) -> str:
        return self.moves[0]

    def local_reward(self, before: PlanPathEnv, action: Any, after: PlanPathEnv) -> float:
        return 0.0
