"""A workflow program with a bug that fails every episode (for the test that such a run stops at once and
shows the program's traceback: tests/integration/test_gateway_e2e.py)."""

from __future__ import annotations

from typing import Any


async def play(task: Any, agents: dict[str, Any], max_turns: int = 6) -> dict[str, Any]:
    chat = [{"role": "user", "content": task.observation["vertical"]}]
    await agents["vertical"].chat.completions.create(model="vertical", messages=chat)
    return {"local": {"vertical": len(chat) / undefined_progress}}  # noqa: F821  (the bug)
