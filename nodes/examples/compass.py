"""A user-written Plan-Path node: a mover that sees a compass instead of the whole grid.

This is the README's "Write your own node" example. It plugs into a run by path alone, with no
registry entry and no edit to the package (configs/examples/custom_node.yaml):

    agents:
      vertical: {node: "nodes.examples.compass:CompassMover", policy: shared}
      horizontal: {node: "nodes.examples.compass:CompassMover", policy: shared}

The stock Plan-Path movers (nodes/plan_path.py) prompt with the whole grid, so a model must learn to
find the token and the goal in it before it can learn to steer. A `CompassMover` reads the same
observation and prompts with just what its own axis needs: how far the goal is along it, and whether each
of its two moves is open ("."), walled or off the grid ("#"). The vertical mover with the goal two rows
down and a wall above it is prompted with

    V GO=D2 U=# D=.

and answers one move, "U" or "D" ("L" or "R" for the horizontal mover). Its reward is the stock one: the
BFS progress of its move, or `invalid_penalty` when the move was blocked or the answer unparsable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mas_async.api import Node, ParseError

if TYPE_CHECKING:
    from envs.plan_path import PlanPathEnv

# agent -> (role letter, index of its coordinate, (move towards smaller index, move towards larger))
AXES = {"vertical": ("V", 0, ("U", "D")), "horizontal": ("H", 1, ("L", "R"))}


class CompassMover(Node):
    """A Plan-Path mover for either agent, prompted with a compass: "V GO=D2 U=# D=."."""

    def __init__(self, agent: str) -> None:
        if agent not in AXES:
            raise ValueError(f"CompassMover plays a Plan-Path agent ({', '.join(AXES)}), not {agent!r}")
        super().__init__(agent)
        self.letter, self.axis, self.moves = AXES[agent]

    def prompt(self, obs: str) -> list[dict[str, str]]:
        # The observation: a role letter, the grid rows, then "A=r,c G=r,c" (envs/plan_path.py).
        lines = obs.split("\n")
        grid, coords = lines[1:-1], lines[-1].split()
        token = [int(x) for x in coords[0][2:].split(",")]
        goal = [int(x) for x in coords[1][2:].split(",")]
        offset = goal[self.axis] - token[self.axis]
        heading = "0" if offset == 0 else f"{self.moves[offset > 0]}{abs(offset)}"
        sides = []
        for step, move in zip((-1, 1), self.moves, strict=True):
            cell = list(token)
            cell[self.axis] += step
            inside = 0 <= cell[0] < len(grid) and 0 <= cell[1] < len(grid[0])
            sides.append(f"{move}={'.' if inside and grid[cell[0]][cell[1]] != '#' else '#'}")
        return [{"role": "user", "content": f"{self.letter} GO={heading} {' '.join(sides)}"}]

    def parse(self, text: str) -> str:
        answer = text.strip()[:1]
        if answer not in self.moves:
            raise ParseError(f"{self.agent}: expected {' or '.join(self.moves)}, got {text[:20]!r}")
        return answer

    def local_reward(self, before: PlanPathEnv, action: Any, after: PlanPathEnv) -> float:
        if after.infos[self.agent]["blocked"]:
            return self.invalid_penalty
        return float(before.distance() - after.distance())
