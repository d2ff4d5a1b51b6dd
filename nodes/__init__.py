"""Agent roles (workflow nodes) and the workflows that orchestrate them, by registry key.

`NODES` and `WORKFLOWS` map a config name to a "module:Class" path (resolved by
`mas_async.registry.resolve`); a user's own node or workflow plugs in by path without being listed here.
"""

from __future__ import annotations

NODES: dict[str, str] = {
    "plan_path_vertical": "nodes.plan_path:VerticalMover",
    "plan_path_horizontal": "nodes.plan_path:HorizontalMover",
    # games and planning
    # code and math
    # examples
}

WORKFLOWS: dict[str, str] = {
    "plan_path": "nodes.plan_path:PlanPathWorkflow",
    # games and planning
    # code and math
    # examples
}
