"""`envs.base` is where the Env base lived; it is `mas_async.api.Env` now (kept importable here)."""

from mas_async.api import SPLITS, Env, check_split

__all__ = ["SPLITS", "Env", "check_split"]
