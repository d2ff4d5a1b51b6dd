"""Nodes and workflows of the math tool team (`envs/math_tool.py`), prompted for small chat models.

- `ToolWriter` (agent "tool_user"): shown the problem (and, on a later turn, the reasoner's answer), it
  writes one line of Python that prints the answer. The prompt ends with the opening of the reply,
  "```python", a newline and "print(", which the model continues (SmolLM2-135M asked for a fenced program
  without that opening writes functions and loops that rarely run; with it, it copies a bare expression
  into the print in about half its samples); the program is "print(" and the completion up to the closing
  fence (or its end), and must parse. Local reward: 1.0 when what it printed is right.
- `AnswerReader` (agent "reasoner"): shown the problem, the program and what it printed, it gives the
  final answer as \\boxed{}; the reply is opened with "\\boxed{" and the answer is what the model writes
  before the closing brace. Local reward: 1.0 when its answer is right. (Rules that said "\\boxed{ANSWER}"
  had SmolLM2-135M write the word ANSWER in every greedy reply of a pilot, 0 of 16 right.)
- `SoloToolAgent` (agent "solo"): one agent in both steps, with one system prompt: it writes the
  program, then reads its output and answers (the same openings of the reply); `MathToolSoloWorkflow`
  asks for the step the env expects.
- `DirectAnswerer` (agent "solo", `envs.math_solo`): the reasoner alone, no program: it answers directly.

No worked example and no answer is in any prompt: the rules, the problem, and what the team did so far.
The rewards are the env's: r = alpha * team reward + the local reward above (`envs.math.MathEnv`).
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Any

from mas_async.api import Node, ParseError
from nodes.parallel import ParallelWorkflow
from nodes.sequential import SequentialWorkflow

if TYPE_CHECKING:
    from envs.math import MathEnv
    from envs.math_tool import MathToolSoloEnv
    from mas_async.api import EpisodeContext as Episode

PROGRAM_START = "```python\nprint("
"""The start of a program reply, given in the prompt: a one-line program that prints the answer."""
PROGRAM_OPENING = "print("
"""The part of `PROGRAM_START` that belongs to the program."""
ANSWER_START = "\\boxed{"
"""The start of an answer reply, given in the prompt."""
PROGRAM_TOKENS = 28
"""Most tokens of a program reply: in SmolLM2's tokens (one a digit), the longest reference program of 2,000
arithmetic training problems, with its closing parenthesis and fence, takes 27."""
ANSWER_TOKENS = 16
"""Most tokens of an answer reply: the longest answer of the same problems, with its closing brace, takes 15."""

TOOL_USER_RULES = (
    "You are the tool user in a team of two that solves a math problem. Write a short Python program that "
    "computes the answer and prints it. Your partner runs it, reads what it prints and gives the final answer. "
    "Reply with one line of Python that prints the answer."
)
REASONER_RULES = (
    "You are the reasoner in a team of two that solves a math problem. Your partner wrote a Python program "
    "for it, and you see what the program printed. Write the final answer, a number, inside \\boxed{}."
)
DIRECT_RULES = "You solve a math problem. Write the final answer, a number, inside \\boxed{}."
SOLO_RULES = (
    "You solve a math problem alone. First write a short Python program that computes the answer and prints "
    "it, one line of Python; you will see what it prints. Then write the final answer, a number, inside \\boxed{}."
)


def read_program(text: str, who: str) -> str:
    """The program of a reply that continues `PROGRAM_START`: "print(" and the text before the closing fence
    (all of it when the fence never closes), which must parse as Python; ParseError (naming `who`) otherwise."""
    code = PROGRAM_OPENING + text.split("```", 1)[0]
    if not code.strip():
        raise ParseError(f"{who}: an empty program")
    try:
        ast.parse(code)
    except (SyntaxError, ValueError) as error:
        raise ParseError(f"{who}: the program does not parse: {error}") from None
    return code


def read_answer(text: str, who: str) -> dict[str, str]:
    """The answer of a reply that continues `ANSWER_START`: the text before the first closing brace (braces
    balanced); ParseError (naming `who`) when the brace never closes or the answer is empty."""
    depth = 0
    for index, char in enumerate(text):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth < 0:
            answer = text[:index].strip()
            if not answer:
                break
            return {"answer": answer, "reasoning": ""}
    raise ParseError(f"{who}: no answer closed by '}}' after \\boxed{{")


def chat(rules: str, obs: Any, start: str) -> list[dict[str, str]]:
    """The rules, the observation, then the reply's start for the model to continue."""
    return [
        {"role": "system", "content": rules},
        {"role": "user", "content": str(obs)},
        {"role": "assistant", "content": start},
    ]


class ToolWriter(Node):
    """Writes the program (see the module docstring)."""

    max_tokens = PROGRAM_TOKENS

    def __init__(self, agent: str = "tool_user") -> None:
        super().__init__(agent)

    def prompt(self, obs: Any) -> list[dict[str, str]]:
        return chat(TOOL_USER_RULES, obs, PROGRAM_START)

    def parse(self, text: str) -> dict[str, str]:
        return {"code": read_program(text, self.agent)}

    def local_reward(self, before: MathEnv, action: Any, after: MathEnv) -> float:
        return 1.0 if after.correct(after.tool_answer) else 0.0


class AnswerReader(Node):
    """Reads the program's output and answers (see the module docstring)."""

    max_tokens = ANSWER_TOKENS

    def __init__(self, agent: str = "reasoner") -> None:
        super().__init__(agent)

    def prompt(self, obs: Any) -> list[dict[str, str]]:
        return chat(REASONER_RULES, obs, ANSWER_START)

    def parse(self, text: str) -> dict[str, str]:
        return read_answer(text, self.agent)

    def local_reward(self, before: MathEnv, action: Any, after: MathEnv) -> float:
        return 1.0 if after.correct(after.reasoner_answer) else 0.0


class SoloToolAgent(Node):
    """Both steps by one agent, one system prompt: `writer` writes the program, `reader` answers."""

    def __init__(self, agent: str = "solo") -> None:
        super().__init__(agent)
        self.writer = _SoloStep(agent, PROGRAM_START, lambda text: {"code": read_program(text, agent)})
        self.writer.max_tokens = PROGRAM_TOKENS
        self.reader = _SoloStep(agent, ANSWER_START, lambda text: read_answer(text, agent))
        self.reader.max_tokens = ANSWER_TOKENS

    def prompt(self, obs: Any) -> list[dict[str, str]]:
        """The first step's prompt (the workflow asks `writer` or `reader` as the env expects)."""
        return self.writer.prompt(obs)

    def parse(self, text: str) -> dict[str, str]:
        raise ParseError(f"{self.agent}: the solo tool agent acts through its writer and reader steps")


class _SoloStep(Node):
    def __init__(self, agent: str, start: str, parse: Any) -> None:
        super().__init__(agent)
        self.start = start
        self._parse = parse

    def prompt(self, obs: Any) -> list[dict[str, str]]:
        return chat(SOLO_RULES, obs, self.start)

    def parse(self, text: str) -> dict[str, str]:
        return self._parse(text)

    def local_reward(self, before: MathToolSoloEnv, action: Any, after: MathToolSoloEnv) -> float:
        return 1.0 if after.correct(after.team_answer()) else 0.0


class DirectAnswerer(Node):
    """The reasoner alone, without a program: answers the problem directly in \boxed{} (the no-tool baseline
    on `envs.math_solo:MathSoloEnv`, `configs/math_direct_smollm2.yaml`). Local reward: 1.0 when right."""

    max_tokens = ANSWER_TOKENS

    def __init__(self, agent: str = "solo") -> None:
        super().__init__(agent)

    def prompt(self, obs: Any) -> list[dict[str, str]]:
        return chat(DIRECT_RULES, obs, ANSWER_START)

    def parse(self, text: str) -> dict[str, str]:
        return read_answer(text, self.agent)

    def local_reward(self, before: MathEnv, action: Any, after: MathEnv) -> float:
        return 1.0 if after.correct(after.reasoner_answer) else 0.0


class MathToolWorkflow(SequentialWorkflow):
    """Each turn the tool user writes and runs a program, then the reasoner answers; the episode ends when
    their answers agree, or after `max_turns` turns."""

    agents = ("tool_user", "reasoner")

    def __init__(self, nodes: dict[str, Node], max_turns: int = 2) -> None:
        super().__init__(nodes, max_turns=max_turns)


class MathToolSoloWorkflow(ParallelWorkflow):
    """The single agent: each turn one step, the program or the answer as the env expects (a team turn is
    both, so compare with max_turns = 2 * the team's)."""

    agents = ("solo",)

    def __init__(self, nodes: dict[str, Node], max_turns: int = 4) -> None:
        super().__init__(nodes, max_turns=max_turns)

    async def run(self, episode: Episode) -> None:
        node = self.nodes["solo"]
        if not isinstance(node, SoloToolAgent):
            raise TypeError(f"{type(self).__name__}: the agent 'solo' needs the node SoloToolAgent, got {node!r}")
        for _ in range(self.max_turns):
            if episode.env.done:
                return
            await episode.act(node.writer if episode.env.expects() == "code" else node.reader)
            episode.next_turn()
