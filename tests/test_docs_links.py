"""Every relative link in README.md and docs/ resolves: the file exists, and an anchor names a heading.

`mkdocs build --strict` (tests/test_docs_site.py) checks the links between pages of the site, but not
the README, which GitHub and PyPI show. Headings become anchors as Python-Markdown's `toc` makes them
(the site's; GitHub's agree for the headings used here). The source inventory is rendered during the
docs build (scripts/mkdocs_hooks.py), so links to it count as resolved without the file.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

from docs_blocks import ROOT, doc_pages

BUILT_AT_DOCS_BUILD = {ROOT / "docs" / "reference" / "source.md"}
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"(`+).+?\1")
FENCE = re.compile(r"^\s*(```|~~~)")


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced blocks, code spans removed."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, CODE_SPAN.sub("", line)))
    return out


def _slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[*_]{1,2}(\S.*?\S|\S)[*_]{1,2}", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (match := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
            slug, n = _slug(match[1]), 1
            while slug in found:
                slug = f"{_slug(match[1])}_{n}"
                n += 1
            found.add(slug)
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for number, line in _prose(page):
        for match in LINK.finditer(line):
            target = match["target"]
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, …
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(ROOT)}:{number}: {target}"
            if resolved in BUILT_AT_DOCS_BUILD:
                continue
            if not resolved.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{where} (no heading with that anchor)")
    return broken


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_a_broken_link_and_anchor_are_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import test_docs_links as module

    monkeypatch.setattr(module, "ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# Title\n\n## The `speedtronic eval` command\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#the-speedtronic-eval-command) [gone](missing.md) [bad](other.md#nope)\n"
        "`[in code](missing.md)` [self](#title-here)\n\n# Title here\n"
    )
    assert broken_links(page) == [
        "page.md:1: missing.md (no such file)",
        "page.md:1: other.md#nope (no heading with that anchor)",
    ]
