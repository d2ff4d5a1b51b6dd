"""Arithmetic problems for the math envs: too hard for a small model's head, easy for a one-line program.

`arithmetic_problems(split, count, word_share=0.5)` draws problems from a seeded generator (the same
problems on every call) for `envs.math.MathEnv.problems(..., dataset="arithmetic")`:

- **expressions**: 2 to 4 operands of 2 to 4 digits joined by +, - and * (a random binary tree, written
  with the parentheses its order needs and no others), e.g. "What is (964 + 59) * 3021?";
- **word problems**: one of `TEMPLATES`, a story over the same arithmetic (its numbers drawn the same
  way, e.g. "A shop packs 412 boxes of 36 cups each and has 1057 loose cups. How many cups does it have?");
  a story whose result would be negative is drawn again.

A problem is {"id", "problem", "answer", "expression", "kind", "answer_form"}: `expression` is the Python
expression that computes the answer (what the reference tool prints), `kind` "expression" or "word". The
answer is the exact integer, written in decimal, and `answer_form` "integer": the envs take only an integer
written out as one (`integer_answer`), so an answer that repeats the problem's expression ("176 - 9179",
which `envs.math_data.equivalent` would evaluate and accept) is wrong: the arithmetic is the task.

**Train and test are disjoint by content, by construction**: a drawn expression belongs to the test split
when a hash of its text falls in one tenth of the range (`TEST_BUCKETS` of `BUCKETS`), else to train, and
each split keeps only its own draws. So no expression (hence no problem) is in both splits, whatever
`count` each asks for, and a held-out problem never shares its arithmetic with a training problem. The
id is a hash of the content, so two equal problems have equal ids.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any

from mas_async.api import check_split

OPERATORS = ("+", "-", "*")
PRECEDENCE = {"+": 1, "-": 1, "*": 2}
OPERANDS = (2, 4)  # operands per expression, inclusive
DIGITS = (2, 4)  # digits per operand, inclusive
BUCKETS, TEST_BUCKETS = 10, 1  # the share of the expression space held out: 1 in 10
SPLIT_SEEDS = {"train": 71_000, "test": 71_001}
MAX_DRAWS_PER_PROBLEM = 1000


@dataclass(frozen=True)
class Template:
    """A word problem over an expression: `expression` and `text` name the operands a, b, c, d."""

    expression: str
    text: str


TEMPLATES: tuple[Template, ...] = (
    Template("a + b", "A library has {a} books and buys {b} more. How many books does it have now?"),
    Template("a - b", "A tank holds {a} liters of water and {b} liters are drained. How many liters are left?"),
    Template("a * b", "A crate holds {a} apples. How many apples are in {b} crates?"),
    Template("a + b + c", "A farm has {a} sheep, {b} goats and {c} cows. How many animals does it have?"),
    Template(
        "a - b - c",
        "A club has {a} dollars. It spends {b} dollars on food and {c} dollars on rent. How many dollars are left?",
    ),
    Template(
        "a * b + c", "A shop packs {a} boxes of {b} cups each and has {c} loose cups. How many cups does it have?"
    ),
    Template(
        "a * b - c", "A factory makes {a} bags of {b} nails each, and {c} nails are lost. How many nails are left?"
    ),
    Template(
        "(a + b) * c",
        "A school has {a} boys and {b} girls, and each student gets {c} sheets of paper. "
        "How many sheets are handed out?",
    ),
    Template(
        "a * b * c",
        "There are {a} trucks, each carries {b} boxes, and each box holds {c} cans. How many cans are there?",
    ),
    Template(
        "a * (b - c)",
        "A seller has {a} bags with {b} beads each, and takes {c} beads out of every bag. "
        "How many beads are left in all?",
    ),
    Template(
        "a * b + c * d",
        "A theater sells {a} tickets at {b} dollars and {c} tickets at {d} dollars. How many dollars does it take in?",
    ),
    Template(
        "a * b - c * d",
        "A store buys {a} packs of {b} pens and sells {c} packs of {d} pens. How many pens does it keep?",
    ),
    Template(
        "a + b + c + d",
        "A runner runs {a} meters, then {b}, then {c}, then {d} meters. How many meters does she run in all?",
    ),
    Template(
        "a * b * c + d",
        "A warehouse has {a} shelves with {b} boxes each, {c} screws in every box, "
        "and {d} loose screws. How many screws are there?",
    ),
    Template(
        "(a + b) * (c + d)",
        "A garden has {a} red and {b} white rows of plants, and each row has "
        "{c} tall and {d} short plants. How many plants are in the garden?",
    ),
)


def arithmetic_problems(split: str, count: int, word_share: float = 0.5) -> list[dict[str, Any]]:
    """The first `count` problems of `split` ("train" or "test"); a share `word_share` of them (drawn per
    problem) are word problems, the rest bare expressions. See the module docstring."""
    check_split(split, count)
    if not isinstance(word_share, int | float) or not 0.0 <= word_share <= 1.0:
        raise ValueError(f"arithmetic problems: word_share is a fraction from 0 to 1, got {word_share!r}")
    rng = random.Random(SPLIT_SEEDS[split])
    problems = []
    for _ in range(count):
        for _ in range(MAX_DRAWS_PER_PROBLEM):
            kind = "word" if rng.random() < word_share else "expression"
            drawn = draw_word(rng) if kind == "word" else draw_expression(rng)
            if drawn is not None and split_of(drawn[0]) == split:
                break
        else:  # pragma: no cover - a tenth of the draws are test ones: this never runs out
            raise RuntimeError(f"arithmetic problems: no {split} problem in {MAX_DRAWS_PER_PROBLEM} draws")
        expression, text = drawn
        problems.append(make_problem(expression, text, kind))
    return problems


def split_of(expression: str) -> str:
    """The split an expression belongs to: "test" for a tenth of the hash range, else "train"."""
    bucket = int.from_bytes(hashlib.sha256(expression.encode()).digest()[:8], "big") % BUCKETS
    return "test" if bucket < TEST_BUCKETS else "train"


def make_problem(expression: str, text: str, kind: str) -> dict[str, Any]:
    """The problem dict of `expression` asked as `text`; its answer computed by `value`."""
    content = f"{kind}\n{expression}\n{text}"
    ident = hashlib.sha256(content.encode()).hexdigest()[:12]
    return {
        "id": f"arithmetic/{ident}",
        "problem": text,
        "answer": str(value(expression)),
        "expression": expression,
        "kind": kind,
        "answer_form": "integer",
    }


INTEGER = re.compile(r"-?(\d{1,3}(,\d{3})+|\d+)")
"""An integer written out: digits, with or without thousands' commas, and a leading minus."""


def integer_answer(gold: str, answer: str | None) -> bool:
    """Whether `answer` is the integer `gold` written out (spaces around it ignored): no expression, no
    unit, no other form."""
    if answer is None or INTEGER.fullmatch(answer.strip()) is None:
        return False
    return int(answer.strip().replace(",", "")) == int(gold)


def operand(rng: random.Random) -> int:
    """A number of 2 to 4 digits (the digit count drawn first, then the number)."""
    digits = rng.randint(*DIGITS)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def draw_expression(rng: random.Random) -> tuple[str, str]:
    """A random expression and its question."""
    expression = render(tree(rng, rng.randint(*OPERANDS)))
    return expression, f"What is {expression}?"


def draw_word(rng: random.Random) -> tuple[str, str] | None:
    """A random template with drawn numbers; None when its result would be negative."""
    template = rng.choice(TEMPLATES)
    names = [n for n in "abcd" if n in template.expression]
    numbers = {n: operand(rng) for n in names}
    expression = template.expression
    for name, number in numbers.items():
        expression = expression.replace(name, str(number))
    if value(expression) < 0:
        return None
    return expression, template.text.format(**numbers)


Tree = int | tuple[str, "Tree", "Tree"]


def tree(rng: random.Random, operands: int) -> Tree:
    """A random binary tree over `operands` numbers, each inner node one of `OPERATORS`."""
    if operands == 1:
        return operand(rng)
    left = rng.randint(1, operands - 1)
    return (rng.choice(OPERATORS), tree(rng, left), tree(rng, operands - left))


def render(node: Tree) -> str:
    """The expression's text with the parentheses its order needs: a child of lower precedence than its
    parent, and a right child of equal precedence under - (a - (b + c)); never others."""
    if isinstance(node, int):
        return str(node)
    op, left, right = node
    left_text, right_text = render(left), render(right)
    if not isinstance(left, int) and PRECEDENCE[left[0]] < PRECEDENCE[op]:
        left_text = f"({left_text})"
    if not isinstance(right, int) and (
        PRECEDENCE[right[0]] < PRECEDENCE[op] or (PRECEDENCE[right[0]] == PRECEDENCE[op] and op == "-")
    ):
        right_text = f"({right_text})"
    return f"{left_text} {op} {right_text}"


def value(expression: str) -> int:
    """The integer value of an expression of integers, +, -, * and parentheses (a small recursive-descent
    reader, never `eval`): how the generator computes each answer."""
    tokens = expression.replace("(", " ( ").replace(")", " ) ").split()
    result, end = _sum(tokens, 0)
    if end != len(tokens):
        raise ValueError(f"not an arithmetic expression: {expression!r}")
    return result


def _sum(tokens: list[str], i: int) -> tuple[int, int]:
    total, i = _product(tokens, i)
    while i < len(tokens) and tokens[i] in ("+", "-"):
        op = tokens[i]
        term, i = _product(tokens, i + 1)
        total = total + term if op == "+" else total - term
    return total, i


def _product(tokens: list[str], i: int) -> tuple[int, int]:
    total, i = _atom(tokens, i)
    while i < len(tokens) and tokens[i] == "*":
        factor, i = _atom(tokens, i + 1)
        total *= factor
    return total, i


def _atom(tokens: list[str], i: int) -> tuple[int, int]:
    if i >= len(tokens):
        raise ValueError("arithmetic expression ends early")
    if tokens[i] == "(":
        inner, i = _sum(tokens, i + 1)
        if i >= len(tokens) or tokens[i] != ")":
            raise ValueError("arithmetic expression: unbalanced parentheses")
        return inner, i + 1
    if not tokens[i].isdigit():
        raise ValueError(f"arithmetic expression: unexpected {tokens[i]!r}")
    return int(tokens[i]), i + 1
