"""Fenced code blocks of the documentation: finding them, and what counts as runnable.

Used by tests/test_docs_blocks.py. A block is runnable when its language is a shell or Python
(RUNNABLE) and the lines right before its opening fence do not include a marker comment
`<!-- not-runnable: REASON -->` (other HTML comments may sit between, e.g. `<!-- test-command -->`).
A line `--8<-- "path"` inside a block (pymdownx.snippets) stands for that file of the repository.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHELL = frozenset({"bash", "sh", "shell", "console"})
PYTHON = frozenset({"python", "py"})
RUNNABLE = SHELL | PYTHON
MARKER = re.compile(r"^<!--\s*not-runnable:\s*(?P<reason>\S.*?)\s*-->$")
COMMENT = re.compile(r"^<!--.*-->$")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"$')


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    skip_reason: str | None

    @property
    def runnable(self) -> bool:
        return self.language in RUNNABLE and self.skip_reason is None

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def doc_pages() -> list[Path]:
    """README.md and every Markdown page under docs/, sorted."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _skip_reason(lines: list[str], fence_index: int) -> str | None:
    i = fence_index - 1
    while i >= 0 and COMMENT.match(lines[i].strip()):
        match = MARKER.match(lines[i].strip())
        if match:
            return match["reason"]
        i -= 1
    return None


def _expand_snippets(code: str) -> str:
    out = []
    for line in code.splitlines():
        match = SNIPPET.match(line.strip())
        out.append((ROOT / match["path"]).read_text(encoding="utf-8").rstrip("\n") if match else line)
    return "\n".join(out) + "\n"


def extract_blocks(path: Path) -> list[Block]:
    """Every fenced block of a page (nested fences inside a longer fence are content, not blocks)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    page = path.relative_to(ROOT).as_posix()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, info = len(match["indent"]), match["fence"], match["info"].strip()
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            close = FENCE.match(lines[j])
            if (
                close
                and close["fence"][0] == fence[0]
                and len(close["fence"]) >= len(fence)
                and not close["info"].strip()
            ):
                break
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        else:
            raise ValueError(f"{page}:{i + 1}: unclosed code fence")
        language = info.split()[0].lower() if info else ""
        blocks.append(Block(page, i + 1, language, _expand_snippets("\n".join(body)), _skip_reason(lines, i)))
        i = j + 1
    return blocks


def shell_script(block: Block) -> str:
    """The commands of a shell block: the whole text, or a console block's `$ ` lines."""
    if block.language != "console":
        return block.code
    commands = [line[2:] for line in block.code.splitlines() if line.startswith("$ ")]
    return "\n".join(commands) + "\n"
