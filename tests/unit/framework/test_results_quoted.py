"""Every learning figure that README.md and docs/ quote from a committed run is the one in its file.

A table quoted from runs opens with a marker comment, then a markdown table whose rows each link a
results folder's eval.jsonl (`mas-async results RUN_DIR results/NAME`) in their first cell:

    <!-- results: curve KEY -->                 columns are iterations; each cell is KEY at that iteration
    <!-- results: at ITERATION KEY_TEMPLATE -->  columns are names; each cell is KEY_TEMPLATE with {name}
                                                 filled in, at ITERATION ("last": the last evaluation)

Cells are compared at the precision they are written with ("0.84" against round(value, 2)); an empty
cell or "-" quotes nothing. A folder quoted anywhere must hold eval.jsonl and config.yaml.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support.paths import ROOT

MARKER = re.compile(r"<!-- results: (curve|at) (.+?) -->")
LINK = re.compile(r"\]\(((?:\.\./)?results/[^)#]+)/eval\.jsonl\)")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def quoted_tables(text: str) -> list[tuple[str, str, list[str], list[list[str]]]]:
    """(kind, spec, header, rows) of every marked table of a page."""
    lines, tables = text.splitlines(), []
    for index, line in enumerate(lines):
        found = MARKER.search(line)
        if not found:
            continue
        body = []
        for row in lines[index + 1 :]:
            if not row.strip().startswith("|"):
                if body:
                    break
                continue
            body.append(_cells(row))
        assert len(body) >= 3, f"the table after {line.strip()!r} has no rows"
        tables.append((found.group(1), found.group(2), body[0], body[2:]))
    return tables


def rows_of(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "eval.jsonl").read_text().splitlines() if line.strip()]


def quoted(kind: str, spec: str, header: str, rows: list[dict]) -> float | None:
    if kind == "curve":
        found = [r for r in rows if r["iteration"] == int(header)]
        return found[0].get(spec) if found else None
    iteration, template = spec.split(" ", 1)
    at = rows[-1] if iteration == "last" else next((r for r in rows if r["iteration"] == int(iteration)), None)
    return None if at is None else at.get(template.format(name=header))


def check_page(page: Path) -> int:
    """Asserts every quoted cell of `page`; returns how many were checked."""
    checked = 0
    for kind, spec, header, body in quoted_tables(page.read_text()):
        for row in body:
            link = LINK.search(row[0])
            assert link, f"{page.name}: a row of the table '{spec}' names no results folder: {row[0]!r}"
            folder = (page.parent / link.group(1)).resolve()
            assert (folder / "config.yaml").is_file(), f"{page.name}: {folder} has no config.yaml"
            rows = rows_of(folder)
            for column, cell in zip(header[1:], row[1:], strict=True):
                if cell in ("", "-"):
                    continue
                value = quoted(kind, spec, column, rows)
                assert value is not None, f"{page.name}: {folder.name} has no {spec} for {column}"
                digits = len(cell.split(".")[1]) if "." in cell else 0
                assert cell == f"{value:.{digits}f}", f"{page.name}: {folder.name} {spec} {column}: {cell} != {value}"
                checked += 1
    return checked


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_quoted_figures_are_the_committed_ones(page: Path) -> None:
    check_page(page)


def test_the_check_sees_a_wrong_figure(tmp_path: Path) -> None:
    folder = tmp_path / "results" / "run"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("run: {}\n")
    rows = [{"iteration": 0, "eval/team_success_rate": 0.109375, "eval/baseline/random/team_success_rate": 0.2},
            {"iteration": 10, "eval/team_success_rate": 0.5}]  # fmt: skip
    (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = tmp_path / "page.md"
    good = (
        "<!-- results: curve eval/team_success_rate -->\n| run | 0 | 10 |\n|---|---|---|\n"
        "| [s0](results/run/eval.jsonl) | 0.11 | 0.50 |\n\n"
        "<!-- results: at 0 eval/baseline/{name}/team_success_rate -->\n| run | random |\n|---|---|\n"
        "| [s0](results/run/eval.jsonl) | 0.20 |\n"
    )
    page.write_text(good)
    assert check_page(page) == 3
    page.write_text(good.replace("0.50", "0.52"))
    with pytest.raises(AssertionError, match="0.52"):
        check_page(page)
    page.write_text(good.replace("| 0.20 |", "| 0.21 |"))
    with pytest.raises(AssertionError, match="0.21"):
        check_page(page)


def test_the_readme_and_the_results_page_quote_committed_runs() -> None:
    """The learning figures of the README and docs/results.md are quoted through marked tables (so checked)."""
    assert check_page(ROOT / "README.md") >= 30
    assert check_page(ROOT / "docs" / "results.md") >= 30
