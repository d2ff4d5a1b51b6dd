"""Agent roles (workflow nodes) and the workflows that orchestrate them, by registry key.

`NODES` and `WORKFLOWS` map a config name to a "module:Class" path (resolved by
`mas_async.registry.resolve`); a user's own node or workflow plugs in by path without being listed here.
"""

from __future__ import annotations

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
    # games and planning
    "sokoban_vertical": "nodes.sokoban:VerticalPusher",
    "sokoban_horizontal": "nodes.sokoban:HorizontalPusher",
    "sudoku_chooser": "nodes.sudoku:CellChooser",
    "sudoku_placer": "nodes.sudoku:DigitPlacer",
    "sokoban_vertical_chat": "nodes.sokoban:ChatVerticalPusher",
    "sokoban_horizontal_chat": "nodes.sokoban:ChatHorizontalPusher",
    "sudoku_chooser_chat": "nodes.sudoku:ChatCellChooser",
    "sudoku_placer_chat": "nodes.sudoku:ChatDigitPlacer",
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
    # code and math
    "code": "nodes.code:CodeWorkflow",
    "math": "nodes.math:MathWorkflow",
    "routed": "nodes.routed:RoutedWorkflow",
    # examples
}
