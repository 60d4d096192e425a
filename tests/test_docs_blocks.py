"""Every shell command and Python snippet in docs/ and README.md runs (unless marked not runnable).

Per page, in document order, in one fresh temporary directory holding a link to the repository's
`configs/`: shell blocks (`bash`, `sh`, `shell`; `$ ` lines of `console`) run with `bash -e -o pipefail`,
Python blocks each as its own process. `speedtronic` on PATH is this checkout's CLI and `python` this
interpreter, with `src/` first on PYTHONPATH. No Hub: HF_HUB_OFFLINE=1, no token, HF_HOME private to
the page. A block is skipped only with `<!-- not-runnable: REASON -->` on the line before its fence
(tests/docs_blocks.py; docs/about-docs.md explains it to writers).

Speed: `speedtronic` commands and Python blocks run as children forked from a server that has imported
torch once (tests/docs_forkserver.py), one compute thread each: about 0.5 s instead of ~10 s a command
on a loaded two-core machine. SPEEDTRONIC_DOCS_NO_FORKSERVER=1 runs them as plain fresh processes
(`python -m speedtronic ...`, `python FILE`) instead, e.g. to rule the server out when a block fails.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from docs_blocks import PYTHON, ROOT, SHELL, Block, doc_pages, extract_blocks, shell_script

SRC = ROOT / "src"
FORKSERVER = Path(__file__).resolve().parent / "docs_forkserver.py"
PAGES = {path.relative_to(ROOT).as_posix(): extract_blocks(path) for path in doc_pages()}
RUNNABLE_PAGES = sorted(page for page, blocks in PAGES.items() if any(b.runnable for b in blocks))
BLOCK_TIMEOUT_S = 300


def test_pages_are_found() -> None:
    assert "README.md" in PAGES and "docs/quickstart.md" in PAGES


def test_every_fence_names_its_language() -> None:
    bare = [b.where() for blocks in PAGES.values() for b in blocks if not b.language]
    assert not bare, f"say the language of these code blocks (```bash, ```yaml, ```text, ...): {bare}"


def test_not_runnable_marks_only_runnable_languages() -> None:
    # A marker on a yaml or text block does nothing, so it is probably on the wrong block.
    stray = [
        b.where()
        for blocks in PAGES.values()
        for b in blocks
        if b.skip_reason and b.language not in SHELL | PYTHON
    ]
    assert not stray, f"not-runnable markers before blocks that are never run: {stray}"


def _base_env(tmp_path: Path) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT")
        and not key.startswith(("SPEEDTRONIC_", "_SPEEDTRONIC", "PYTEST_"))
    }
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
        HF_HOME=str(tmp_path / "hf_home"),
        HF_HUB_OFFLINE="1",
        COLUMNS="200",
        OMP_NUM_THREADS="1",
        NO_MKDOCS_2_WARNING="1",
    )
    return env


@pytest.fixture(scope="module")
def forkserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str | None]:
    """The socket of a running fork server, or None to run plain processes."""
    if (
        os.environ.get("SPEEDTRONIC_DOCS_NO_FORKSERVER")
        or not hasattr(os, "fork")
        or not hasattr(socket, "AF_UNIX")
    ):
        yield None
        return
    tmp = tmp_path_factory.mktemp("forkserver")
    socket_path = str(tmp / "s")
    server = subprocess.Popen(
        [sys.executable, str(FORKSERVER), "serve", socket_path],
        env=_base_env(tmp),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline()  # "ready" once torch is imported and the socket listens
        if line.strip() != "ready":
            server.kill()
            pytest.fail(f"the docs fork server did not start: {line}{server.stderr.read()}")
        yield socket_path
    finally:
        server.kill()
        server.wait(timeout=30)


def _workspace(tmp_path: Path, server: str | None) -> tuple[Path, dict[str, str]]:
    work = tmp_path / "work"
    work.mkdir()
    (work / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cli = f'"{sys.executable}" "{FORKSERVER}" cli' if server else f'"{sys.executable}" -m speedtronic'
    for name, command in (("speedtronic", cli), ("python", f'"{sys.executable}"')):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        shim.chmod(0o755)
    (bin_dir / "python3").symlink_to(bin_dir / "python")
    env = _base_env(tmp_path)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    if server:
        env["SPEEDTRONIC_DOCS_FORKSERVER"] = server
    return work, env


def _run(
    block: Block, work: Path, env: dict[str, str], server: str | None
) -> subprocess.CompletedProcess[str]:
    if block.language in PYTHON:
        script = work.parent / f"block_line{block.line}.py"
        script.write_text(block.code, encoding="utf-8")
        command = (
            [sys.executable, str(FORKSERVER), "python", str(script)]
            if server
            else [sys.executable, str(script)]
        )
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", shell_script(block)]
    return subprocess.run(
        command, cwd=work, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, check=False
    )


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_page_blocks_run(page: str, tmp_path: Path, forkserver: str | None) -> None:
    work, env = _workspace(tmp_path, forkserver)
    for block in PAGES[page]:
        if not block.runnable:
            continue
        result = _run(block, work, env, forkserver)
        if result.returncode != 0:
            pytest.fail(
                f"{block.where()}: the {block.language} block exited {result.returncode}\n"
                f"--- block ---\n{block.code}\n--- stdout (tail) ---\n{result.stdout[-2000:]}\n"
                f"--- stderr (tail) ---\n{result.stderr[-4000:]}\n"
                "Fix the block, or mark it with <!-- not-runnable: REASON --> on the line before its fence.",
                pytrace=False,
            )
