"""Plausible wrong programs for a code problem: what the tester's tests must tell apart from the reference.

A test earns the tester credit only if it discriminates (`envs/code.py`, `CodeEnv.tester_reward`): it
fails at least one of these, not only a program that returns None (which any assert on a value fails,
`assert f(x) is not None` included). Built from the problem's reference solution:

- constants: an entry point that returns the same value for every call (0, "" or []; for a stdin
  problem, a program that prints nothing or 0). They are judged without running any program
  (`mas_async.api.run_tests_on_constant`);
- mutants: the reference with one small change of the kind a slip makes (`MUTATIONS`): a comparison
  turned (`<` to `<=`, `==` to `!=`, ...), an integer constant off by one, `+` and `-` swapped. Each
  mutation is applied at its first site in the program, so there are at most three mutants; a mutant
  that changes nothing the tests can see is harmless (a test needs to fail one wrong program, not all).
"""

from __future__ import annotations

import ast
from typing import Any

FUNCTION_CONSTANTS: tuple[Any, ...] = (0, "", [])
STDIN_CONSTANTS: tuple[Any, ...] = ("", "0")
TURNED = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}


def constants(problem: dict[str, Any]) -> tuple[Any, ...]:
    return FUNCTION_CONSTANTS if problem["entry_point"] else STDIN_CONSTANTS


def _turn_comparison(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and type(node.ops[0]) in TURNED:
            node.ops[0] = TURNED[type(node.ops[0])]()
            return True
    return False


def _off_by_one(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            node.value += 1
            return True
    return False


def _swap_plus_minus(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub):
            node.op = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
            return True
    return False


MUTATIONS = (_turn_comparison, _off_by_one, _swap_plus_minus)


def mutants(problem: dict[str, Any]) -> list[str]:
    """The reference with each of MUTATIONS applied at its first site (those that found one)."""
    solution = problem.get("solution")
    if not solution:
        return []
    found = []
    for mutate in MUTATIONS:
        try:
            tree = ast.parse(solution)
        except SyntaxError:
            return []
        if mutate(tree):
            mutant = ast.unparse(tree)
            if mutant != ast.unparse(ast.parse(solution)):
                found.append(mutant)
    return found
