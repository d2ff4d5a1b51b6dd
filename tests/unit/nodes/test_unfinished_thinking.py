"""The chat movers never read a move out of unfinished reasoning. A Qwen3 reply cut at max_tokens inside its
`<think>` block holds letters that are no decision ("maybe U? or D"); taking the last one would play a move the
model never chose, silently. Such a reply is the node's ParseError (a penalised invalid candidate); a move after
a closed `</think>` is read from the text after it, and a block opened again after it counts for nothing."""

from __future__ import annotations

import pytest

from mas_async.api import Node, ParseError
from nodes.parsing import strip_thinking
from nodes.plan_path import ChatHorizontalMover, ChatVerticalMover
from nodes.sokoban import ChatHorizontalPusher, ChatVerticalPusher
from nodes.solo import ChatSoloPlacer, ChatSoloPusher
from nodes.sudoku import ChatCellChooser, ChatDigitPlacer

# (node, a reply cut inside its thinking that names a valid answer, the same thinking closed then answered,
#  another valid answer that a block opened again after the answer names)
CASES = [
    (ChatVerticalMover(), "<think>The goal is below. Up would hit the wall, so D", "<think>U or D?</think>\nD", "U"),
    (ChatHorizontalMover(), "<think>Left is a wall; R", "<think>L? no</think> R", "L"),
    (ChatVerticalPusher(), "<think>Push it down: D", "<think>U?</think>I move D.", "U"),
    (ChatHorizontalPusher(), "<think>Maybe L", "<think>R</think>L", "R"),
    (ChatCellChooser(), "<think>Cell B looks easy: B", "<think>A</think>The easiest cell is D.", "C"),
    (ChatDigitPlacer(), "<think>Row 1 lacks a 3, so 3", "<think>1</think>It is 4", "7"),
    (ChatSoloPusher(), "<think>Push right: R", "<think>U?</think>Push it: R", "L"),
    (ChatSoloPlacer(), "<think>B needs a 2: B2", "<think>A1</think>So B2.", "C4"),
]
IDS = [type(case[0]).__name__ for case in CASES]


@pytest.mark.parametrize(("node", "cut", "closed", "other"), CASES, ids=IDS)
def test_a_move_only_inside_unfinished_thinking_is_refused(node: Node, cut: str, closed: str, other: str) -> None:
    with pytest.raises(ParseError, match=node.agent):
        node.parse(cut)


@pytest.mark.parametrize(("node", "cut", "closed", "other"), CASES, ids=IDS)
def test_a_move_after_closed_thinking_is_read_after_it(node: Node, cut: str, closed: str, other: str) -> None:
    answer = node.parse(closed)
    assert answer in closed.rsplit("</think>", 1)[1] and answer != other
    assert node.parse(f"{closed}\n<think>Or rather {other}") == answer  # thinking again after the answer, cut off


def test_thinking_opened_again_counts_for_nothing() -> None:
    assert strip_thinking("<think>a</think> U <think> D") == " U "
    assert strip_thinking("<think>a</think> U") == " U"
    assert strip_thinking("<think> D") == ""
    assert strip_thinking("plain U") == "plain U"
    with pytest.raises(ParseError, match="unfinished <think>"):
        ChatVerticalMover().parse("<think>a</think> <think> D")
