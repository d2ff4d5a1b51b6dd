"""Environments that workflows run on, by registry key.

`ENVS` maps a config name to a "module:Class" path (resolved by `mas_async.registry.resolve`); a user's
own env plugs in by path without being listed here. Every env subclasses `envs.base.Env`.
"""

from __future__ import annotations

ENVS: dict[str, str] = {
    "plan_path": "envs.plan_path:PlanPathEnv",
    "plan_path_solo": "envs.plan_path_solo:PlanPathSoloEnv",
    "sokoban_solo": "envs.sokoban_solo:SokobanSoloEnv",
    "sudoku_solo": "envs.sudoku_solo:SudokuSoloEnv",
    "code_solo": "envs.code_solo:CodeSoloEnv",
    "math_solo": "envs.math_solo:MathSoloEnv",
    # games and planning
    "sokoban": "envs.sokoban:SokobanEnv",
    "sudoku": "envs.sudoku:SudokuEnv",
    # code and math
    "code": "envs.code:CodeEnv",
    "math": "envs.math:MathEnv",
    "math_routed": "envs.math:RoutedMathEnv",
}
