"""MkDocs hooks of the documentation site (mkdocs.yml `hooks:`): pages made at build time.

1. The pages of reference/ are generated from the code and kept in the checkout (`mas_async.reference_pages`;
   a test checks each is current): configuration.md from the typed config models (`mas_async.config_reference`),
   envs-and-models.md from the env and model registries (`mas_async.catalog`), metrics.md from the metrics
   table (`mas_async.metrics_reference`). Why a generator and not mkdocstrings: the
   reference a user needs is the dotted keys they type (`policies.<policy>.lora.r`), with pydantic's
   defaults, default factories and Field constraints; mkdocstrings renders Python classes and attributes,
   and would need a pydantic extension on top to show even the constraints, never the paths.
2. The pages are written to be read on the repository too, so they link to files outside docs/
   (`../bench/README.md`, `../mas_async/config.py`). Each such link is checked and points into the site:
   a Markdown file outside docs/ becomes a page of the site under `repo/` (its own links treated alike),
   any other file is copied there as is. A link to a file that does not exist is a warning, which fails
   `mkdocs build --strict` like every broken link between pages.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parent.parent


log = logging.getLogger("mkdocs.hooks.mas_async")

REFERENCE = "reference/configuration.md"
REPO = "repo"
"""Where files of the repository outside docs/ go in the site."""
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")
FENCE = re.compile(r"^[ \t]*(```|~~~)", re.MULTILINE)


def on_files(files: Files, config: Any) -> Files:
    pending = [(f.src_uri, Path(f.abs_src_path)) for f in files if f.src_uri.endswith(".md") and f.abs_src_path]
    added: set[str] = set()
    while pending:
        _, path = pending.pop()
        for target in _outside_targets(path.read_text(), path.resolve().relative_to(ROOT).as_posix()):
            if target in added or not (ROOT / target).is_file():
                continue  # a missing file is reported where the link is rewritten
            added.add(target)
            # In the site, not in the nav: reached through the links that name it.
            files.append(
                File.generated(
                    config, f"{REPO}/{target}", abs_src_path=str(ROOT / target), inclusion=InclusionLevel.NOT_IN_NAV
                )
            )
            if target.endswith(".md"):
                pending.append((f"{REPO}/{target}", ROOT / target))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    src = page.file.src_uri
    if src == REFERENCE:
        return markdown
    here = src.removeprefix(f"{REPO}/") if src.startswith(f"{REPO}/") else f"docs/{src}"

    def rewrite(match: re.Match[str]) -> str:
        url = match.group(2)
        target = _resolve(url, here)
        if target is None:
            return match.group(0)
        path, anchor = target
        if path.startswith("docs/"):
            if src.startswith(f"{REPO}/"):  # a repository page's link into docs/: the site's page
                new = posixpath.relpath(path.removeprefix("docs/"), posixpath.dirname(src) or ".")
                return f"{match.group(1)}{new}{anchor}{match.group(3)}"
            return match.group(0)  # between pages of docs/: mkdocs checks it
        if not (ROOT / path).is_file():
            log.warning("Doc file '%s' links to '%s', which is not a file of the repository (%s)", src, url, path)
            return match.group(0)
        new = posixpath.relpath(f"{REPO}/{path}", posixpath.dirname(src) or ".")
        return f"{match.group(1)}{new}{anchor}{match.group(3)}"

    return _outside_code(markdown, lambda text: LINK.sub(rewrite, text))


def _outside_targets(markdown: str, here: str) -> list[str]:
    """Repository paths of the files outside docs/ that the Markdown at `here` links to."""
    found: list[str] = []

    def collect(text: str) -> str:
        for match in LINK.finditer(text):
            target = _resolve(match.group(2), here)
            if target is not None and not target[0].startswith("docs/"):
                found.append(target[0])
        return text

    _outside_code(markdown, collect)
    return found


def _resolve(url: str, here: str) -> tuple[str, str] | None:
    """(repository path, "#anchor" or "") of a relative link from the file at `here`; None for a URL, an
    absolute path or an anchor alone."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", url) or url.startswith(("/", "#")):
        return None
    path, _, anchor = url.partition("#")
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(here), path))
    if joined.startswith(".."):
        return None
    return joined, f"#{anchor}" if anchor else ""


def _outside_code(markdown: str, apply: Any) -> str:
    """Apply `apply` to the text between fenced code blocks only (a block's `a[i](b)` is no link)."""
    parts = FENCE.split(markdown)
    out, inside, i = [], False, 0
    while i < len(parts):
        part = parts[i]
        if part in ("```", "~~~"):
            inside = not inside
            out.append(part)
        else:
            out.append(part if inside else apply(part))
        i += 1
    return "".join(out)
