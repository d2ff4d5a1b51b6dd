"""Environments that workflows run on, by registry key.

`ENVS` maps a config name to a "module:Class" path (resolved by `mas_async.registry.resolve`); a user's
own env plugs in by path without being listed here. Every env subclasses `envs.base.Env`.
"""

from __future__ import annotations

ENVS: dict[str, str] = {
    "plan_path": "envs.plan_path:PlanPathEnv",
    # games and planning
    # code and math
}
