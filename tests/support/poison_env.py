"""Plan-Path with one poisoned training problem: an env worker that resets an env on it is SIGKILLed at once,
as an out-of-memory kill on one long prompt would end it. `env.name: tests.support.poison_env:PoisonPlanPath`;
the poisoned problem is train problem POISONED (its problem id is f"train{POISONED}")."""

from __future__ import annotations

import os
import signal
from typing import Any

from envs.plan_path import PlanPathEnv

POISONED = 3


class PoisonPlanPath(PlanPathEnv):
    @classmethod
    def problems(cls, split: str, count: int, **options: Any) -> list[dict[str, Any]]:
        problems = super().problems(split, count, **options)
        if split == "train" and count > POISONED:
            problems[POISONED] = {**problems[POISONED], "poison": True}
        return problems

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        if ((options or {}).get("problem") or {}).get("poison"):
            os.kill(os.getpid(), signal.SIGKILL)
        super().reset(seed, options)
