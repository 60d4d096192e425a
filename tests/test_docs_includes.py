"""Files shown in the docs are written out in full (so they read well on GitHub, where mkdocs' `--8<--`
includes show as bare lines); a `<!-- file: PATH -->` comment before a fence names the file the block
must equal, so a copy cannot drift from the file."""

from __future__ import annotations

import re

import pytest

from docs_blocks import ROOT, doc_pages

MARKED = re.compile(r"^<!-- file: (?P<path>\S+) -->\n```[^\n]*\n(?P<code>.*?)\n```$", re.S | re.M)


def copies() -> list[tuple[str, str, str]]:
    found = []
    for page in doc_pages():
        text = page.read_text(encoding="utf-8")
        found += [(str(page.relative_to(ROOT)), m["path"], m["code"]) for m in MARKED.finditer(text)]
    return found


def test_no_page_uses_snippet_includes() -> None:
    for page in doc_pages():
        lines = page.read_text(encoding="utf-8").splitlines()
        assert not [line for line in lines if line.strip().startswith("--8<--")], page


@pytest.mark.parametrize(("page", "path", "code"), copies(), ids=lambda value: str(value)[:60])
def test_a_copied_file_equals_the_file(page: str, path: str, code: str) -> None:
    assert code == (ROOT / path).read_text(encoding="utf-8").rstrip("\n"), (
        f"{page}: the copy of {path} drifted"
    )


def test_the_plugin_guide_shows_both_files() -> None:
    assert {path for page, path, _ in copies() if page == "docs/guides/plugins.md"} == {
        "plugins/speedtronic-example/pyproject.toml",
        "plugins/speedtronic-example/src/speedtronic_example/plugin.py",
    }
