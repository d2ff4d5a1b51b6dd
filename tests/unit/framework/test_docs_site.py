"""The documentation site: `mkdocs build --strict` passes (no broken link, missing page or page outside the
nav), its configuration reference lists every field of every config model with its docstring, and the
code of "Write your own agent, env and workflow" runs as written."""

from __future__ import annotations

import html
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

import mas_async.config as config_module
from mas_async.config_reference import entries, reference_markdown
from tests.support.paths import ROOT

pytest.importorskip("mkdocs", reason="mkdocs is in the dev extra (pip install -e '.[dev]')")
pytest.importorskip("material", reason="mkdocs-material is in the dev extra (pip install -e '.[dev]')")


def _config_models() -> list[type[BaseModel]]:
    """Every config model declared in mas_async/config.py (the private base of the sections aside)."""
    return [
        cls
        for name, cls in inspect.getmembers(config_module, inspect.isclass)
        if issubclass(cls, BaseModel) and cls.__module__ == config_module.__name__ and not name.startswith("_")
    ]


def _text(markup: str) -> str:
    """What a reader sees of HTML (or of Markdown's inline code): tags and backticks gone, one space apart."""
    spaced = re.sub(r"</?(td|th|tr|p|h[1-6]|li|table|div)\b[^>]*>", " ", markup)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", spaced)).replace("`", "").split())


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    return out


def test_the_site_builds_with_strict_checks(site: Path) -> None:
    assert (site / "index.html").is_file()
    assert (site / "reference" / "configuration" / "index.html").is_file()
    # A link to a repository file outside docs/ (docs/staleness.md -> ../bench/README.md) lands on a page.
    assert 'href="../repo/bench/"' in (site / "staleness" / "index.html").read_text()
    assert (site / "repo" / "bench" / "index.html").is_file()


def test_every_config_field_has_a_docstring() -> None:
    missing = [
        f"{m.__name__}.{f}" for m in _config_models() for f, info in m.model_fields.items() if not info.description
    ]
    assert not missing, f"config fields without a docstring under their declaration: {missing}"


def test_the_reference_lists_every_field_of_every_config_model(site: Path) -> None:
    listed = {(e.model, e.field): e for e in entries()}
    page = _text((site / "reference" / "configuration" / "index.html").read_text())
    for model in _config_models():
        for field, info in model.model_fields.items():
            entry = listed.get((model, field))
            assert entry is not None, f"{model.__name__}.{field} is not in the configuration reference"
            assert entry.path in page, f"{entry.path} is not on the built reference page"
            doc = " ".join((info.description or "").replace("`", "").split())
            assert doc in page, f"{entry.path}: its docstring is not on the page"


def test_a_reference_row_shows_type_bounds_and_default() -> None:
    rows = reference_markdown().splitlines()
    assert "| `algorithm.k` | int, &gt;= 1 | `4` | Candidates per agent per turn" in "\n".join(rows)
    assert any(r.startswith("| `policies.<policy>.lora.r` | int, &gt;= 1 | `8` |") for r in rows)
    assert any(r.startswith('| `metrics.wandb.mode` | "online" \\| "offline" | `online` |') for r in rows)
    assert any(r.startswith("| `cluster.nodes[].address` | str | required |") for r in rows)


def test_the_extending_page_code_runs() -> None:
    """Every Python block of docs/extending.md, in order, in one namespace, as a reader would paste them."""
    page = (ROOT / "docs" / "extending.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", page, flags=re.S | re.M)
    assert len(blocks) >= 4
    namespace: dict[str, object] = {"__name__": "docs_extending"}
    for block in blocks:
        exec(compile(block, "docs/extending.md", "exec"), namespace)
    speaker, echo = namespace["speaker"], namespace["Echo"]
    assert speaker.parse(" W7 ") == "W7"  # type: ignore[attr-defined]
    assert len(echo.problems("test", 2)) == 2  # type: ignore[attr-defined]


def test_the_reference_pages_in_the_checkout_are_what_the_code_generates_now() -> None:
    from mas_async.reference_pages import stale_pages

    stale = stale_pages()
    assert not stale, f"{stale} are not what the code generates: run python -m mas_async.reference_pages"
