"""Math problems and answer checking for the math envs (`envs/math.py`).

A problem is a plain dict {"id": str, "problem": str, "answer": str}, the answer in LaTeX or plain text.
The shipped splits (`envs/data/math_train.jsonl`, `math_test.jsonl`, 32 problems each, disjoint) are
our own; `load_jsonl(path)` also reads AIME-style rows ({"problem", "answer"}, any capitalisation,
e.g. "Problem"/"Answer") and OlympiadBench-style rows ({"question", "final_answer": ["$...$"]}).

`equivalent(gold, answer)` decides mathematical equivalence with `math-verify` (numbers, fractions,
decimals, percentages, expressions, sets, intervals, LaTeX), never string equality; each distinct
pair is decided once per process. `last_boxed(text)` extracts the content of the last \\boxed{...}.
"""

from __future__ import annotations

import json
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

DATA = Path(__file__).with_name("data")
SPLIT_FILES = {"train": DATA / "math_train.jsonl", "test": DATA / "math_test.jsonl"}
MAX_ANSWER_CHARS = 200  # longer answers are not parsed (math-verify can be slow on huge inputs)
PROBLEM_KEYS = ("problem", "question")
ANSWER_KEYS = ("answer", "final_answer", "expected_answer")


def load_split(split: str) -> list[dict[str, Any]]:
    """The shipped problems of `split` ("train" or "test")."""
    return load_jsonl(SPLIT_FILES[split])


def load_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Problems from a JSONL file of the shipped, AIME-style or OlympiadBench-style layout."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"math dataset {str(path)!r} does not exist")
    problems = []
    for index, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        row = {key.lower(): value for key, value in json.loads(line).items()}
        problem = next((row[k] for k in PROBLEM_KEYS if row.get(k)), None)
        answer = next((row[k] for k in ANSWER_KEYS if row.get(k) not in (None, "", [])), None)
        if problem is None or answer is None:
            raise ValueError(
                f"{path}: line {index + 1} needs a problem ({'/'.join(PROBLEM_KEYS)}) and an answer "
                f"({'/'.join(ANSWER_KEYS)}); it has keys {', '.join(sorted(row))}"
            )
        if isinstance(answer, list):  # OlympiadBench: a list of answers of a multi-part problem
            answer = ", ".join(_strip_dollars(str(a)) for a in answer)
        ident = row.get("id", row.get("idx", index))
        problems.append({"id": f"{path.stem}/{ident}", "problem": str(problem), "answer": _strip_dollars(str(answer))})
    return problems


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces balanced; None if none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None  # unbalanced: the answer was cut off


def equivalent(gold: str, answer: str | None) -> bool:
    """Whether `answer` is mathematically equal to `gold` (math-verify), e.g. 1/2 == 0.5 == \\frac12."""
    if answer is None:
        return False
    gold, answer = _strip_dollars(gold), _strip_dollars(answer)
    if not answer or len(answer) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False
    return _equivalent(gold, answer)


@lru_cache(maxsize=1 << 16)
def _equivalent(gold: str, answer: str) -> bool:
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    parsed_gold = parse(f"${gold}$", parsing_timeout=timeout)
    parsed = parse(f"${answer}$", parsing_timeout=timeout)
    if not parsed_gold or not parsed:
        return gold.strip() == answer.strip()
    return bool(verify(parsed_gold, parsed, timeout_seconds=timeout))


def _strip_dollars(text: str) -> str:
    return text.strip().strip("$").strip()
