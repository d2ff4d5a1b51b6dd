"""Resolve the names in a config to classes: a registry key ("plan_path") or a "module:Class" path.

Registries are plain dicts from key to "module:Class" strings (no import-time magic): ENVS, NODES,
WORKFLOWS (the shipped envs/ and nodes/ packages) and BACKENDS (inference engines). Being strings, they
import nothing until a name is resolved, so the framework never imports user packages directly. A
user's own class plugs in by path, e.g. `node: "my_pkg.my_nodes:Scout"` or
`backend: "my_pkg.engines:MyBackend"`, without editing the package. An import error in a user's module
is raised as is: a broken plugin is never hidden.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping


class RegistryError(ValueError):
    """A name in the config names no known class."""


def resolve(name: str, registry: Mapping[str, str], kind: str) -> type:
    """Return the class named by `name`: a key of `registry` or a "module:Class" path."""
    path = registry.get(name, name)
    if ":" not in path:
        known = ", ".join(sorted(registry)) or "(none)"
        raise RegistryError(f"unknown {kind} {name!r}: known {kind}s are {known}, or give a 'module:Class' path")
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise RegistryError(f"{kind} {name!r}: module {module_name!r} has no attribute {attr!r}") from None


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
    # the tool + plan team (Stronger-MAS): agents "tool" and "plan"
    "plan_path_toolplan": "envs.tool_plan:PlanPathToolPlanEnv",
    "plan_path_tool_alone": "envs.tool_plan:PlanPathToolAloneEnv",
    "plan_path_plan_alone": "envs.tool_plan:PlanPathPlanAloneEnv",
    "sokoban_toolplan": "envs.tool_plan:SokobanToolPlanEnv",
    "sudoku_toolplan": "envs.tool_plan:SudokuToolPlanEnv",
    # code and math
    "code": "envs.code:CodeEnv",
    "math": "envs.math:MathEnv",
    "math_routed": "envs.math:RoutedMathEnv",
}

NODES: dict[str, str] = {
    "plan_path_vertical": "nodes.plan_path:VerticalMover",
    "plan_path_horizontal": "nodes.plan_path:HorizontalMover",
    "plan_path_solo": "nodes.plan_path:SoloMover",
    "sokoban_solo": "nodes.solo:SoloPusher",
    "sudoku_solo": "nodes.solo:SoloPlacer",
    "code_solo": "nodes.solo:SoloCoder",
    "math_solo": "nodes.solo:SoloReasoner",
    "sokoban_solo_chat": "nodes.solo:ChatSoloPusher",
    "sudoku_solo_chat": "nodes.solo:ChatSoloPlacer",
    "plan_path_vertical_chat": "nodes.plan_path:ChatVerticalMover",
    "plan_path_horizontal_chat": "nodes.plan_path:ChatHorizontalMover",
    "plan_path_vertical_answer": "nodes.plan_path_answer:AnswerVerticalMover",
    "plan_path_horizontal_answer": "nodes.plan_path_answer:AnswerHorizontalMover",
    "plan_path_vertical_grid": "nodes.plan_path_grid:GridVerticalMover",
    "plan_path_horizontal_grid": "nodes.plan_path_grid:GridHorizontalMover",
    "plan_path_solo_grid": "nodes.plan_path_grid:SoloGridMover",
    # games and planning
    "sokoban_vertical": "nodes.sokoban:VerticalPusher",
    "sokoban_horizontal": "nodes.sokoban:HorizontalPusher",
    "sudoku_chooser": "nodes.sudoku:CellChooser",
    "sudoku_placer": "nodes.sudoku:DigitPlacer",
    "sokoban_vertical_chat": "nodes.sokoban:ChatVerticalPusher",
    "sokoban_horizontal_chat": "nodes.sokoban:ChatHorizontalPusher",
    "sokoban_vertical_answer": "nodes.sokoban_answer:AnswerVerticalPusher",
    "sokoban_horizontal_answer": "nodes.sokoban_answer:AnswerHorizontalPusher",
    "sudoku_chooser_chat": "nodes.sudoku:ChatCellChooser",
    "sudoku_placer_chat": "nodes.sudoku:ChatDigitPlacer",
    # the tool + plan team (Stronger-MAS)
    "plan_path_tool": "nodes.tool_plan:PlanPathTool",
    "plan_path_plan": "nodes.tool_plan:PlanPathPlan",
    "plan_path_tool_alone": "nodes.tool_plan:PlanPathToolAlone",
    "plan_path_plan_alone": "nodes.tool_plan:PlanPathPlanAlone",
    "sokoban_tool": "nodes.tool_plan:SokobanTool",
    "sokoban_plan": "nodes.tool_plan:SokobanPlan",
    "sudoku_tool": "nodes.tool_plan:SudokuTool",
    "sudoku_plan": "nodes.tool_plan:SudokuPlan",
    # code and math
    "code_coder": "nodes.code:Coder",
    "code_tester": "nodes.code:Tester",
    "math_reasoner": "nodes.math:Reasoner",
    "math_tool_user": "nodes.math:ToolUser",
    "routed_solver": "nodes.routed:Solver",
    "routed_verifier": "nodes.routed:Verifier",
    # examples
}

WORKFLOWS: dict[str, str] = {
    "plan_path": "nodes.plan_path:PlanPathWorkflow",
    "plan_path_solo": "nodes.plan_path:PlanPathSoloWorkflow",
    "sokoban_solo": "nodes.solo:SokobanSoloWorkflow",
    "sudoku_solo": "nodes.solo:SudokuSoloWorkflow",
    "code_solo": "nodes.solo:CodeSoloWorkflow",
    "math_solo": "nodes.solo:MathSoloWorkflow",
    # games and planning
    "sokoban": "nodes.sokoban:SokobanWorkflow",
    "sudoku": "nodes.sudoku:SudokuWorkflow",
    "tool_plan": "nodes.tool_plan:ToolPlanWorkflow",
    # code and math
    "code": "nodes.code:CodeWorkflow",
    "math": "nodes.math:MathWorkflow",
    "routed": "nodes.routed:RoutedWorkflow",
    # examples
}

BACKENDS: dict[str, str] = {
    "hf": "mas_async.inference.backends.hf:HFBackend",
    "vllm": "mas_async.inference.backends.vllm:VLLMBackend",
    "mock": "mas_async.inference.backends.mock:MockEngine",
}
"""Inference backends: a class taking `(model_path, *, dtype, max_batch_sequences, seed)` that implements
`mas_async.inference.backends.base.InferenceBackend` (or a synchronous engine, wrapped in a thread)."""
