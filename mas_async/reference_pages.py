"""The reference pages of docs/reference/, generated from the code and kept in the checkout.

`python -m mas_async.reference_pages` writes them; tests/unit/framework/test_docs_site.py checks that each
committed page is what its generator gives now, so a page can be read in the repository (and linked from
any other page) and still never drift from the code.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mas_async.catalog import catalog_markdown
from mas_async.config_reference import reference_markdown
from mas_async.metrics_reference import metrics_markdown

ROOT = Path(__file__).resolve().parents[1]
PAGES: dict[str, Callable[[], str]] = {
    "docs/reference/configuration.md": reference_markdown,
    "docs/reference/envs-and-models.md": catalog_markdown,
    "docs/reference/metrics.md": metrics_markdown,
}
"""Each page's path in the repository, and what writes it."""


def stale_pages(root: Path = ROOT) -> list[str]:
    """The pages whose file is not what their generator gives now (missing ones included)."""
    return [path for path, make in PAGES.items() if not (root / path).is_file() or (root / path).read_text() != make()]


def main() -> None:
    for path, make in PAGES.items():
        target = ROOT / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(make())
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
