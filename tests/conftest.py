"""Shared fixtures: running the real CLI in a subprocess, an isolated Hugging Face environment, and
restoring the process-wide set of remembered secrets."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

# One compute thread per test process (inherited by the subprocesses tests start): several training
# processes at once on a small machine otherwise spin-wait on each other's cores, many times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import speedtronic
from speedtronic import secrets

SRC_DIR = Path(speedtronic.__file__).resolve().parents[1]
KNOWN_SECRETS: set[str] = secrets._known_secrets  # remembered token values (scrubbed from output)
TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


@pytest.fixture
def run_cli(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run `python -m speedtronic ARGS` (or `python -c python_code`) in a fresh process.

    The child sees `src` first on PYTHONPATH, no HF token unless `env` gives one, HF_HOME in tmp_path
    (so no stored login is found) and a wide terminal (so rich never wraps a line we search).
    `stderr_file` sends the child's stderr to that file instead of a pipe.
    """

    def run(
        *args: object,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        python_code: str | None = None,
        stderr_file: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        child_env = {key: value for key, value in os.environ.items() if key not in TOKEN_VARIABLES}
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC_DIR), child_env.get("PYTHONPATH")]))
        child_env["HF_HOME"] = str(tmp_path / "hf_home")
        child_env["COLUMNS"] = "1000"
        child_env.update(env or {})
        command = (
            [sys.executable, "-c", python_code] if python_code else [sys.executable, "-m", "speedtronic"]
        )
        if stderr_file is not None:  # stderr to a real file (result.stderr is then empty)
            with stderr_file.open("w", encoding="utf-8") as err:
                return subprocess.run(
                    [*command, *map(str, args)],
                    cwd=cwd or tmp_path,
                    env=child_env,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                    timeout=120,
                )
        return subprocess.run(
            [*command, *map(str, args)],
            cwd=cwd or tmp_path,
            env=child_env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    return run


@pytest.fixture
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HOME in a temporary directory and no HF token in the environment; returns HF_HOME."""
    hf_home = tmp_path / "hf_home"
    hf_home.mkdir()
    monkeypatch.setenv("HF_HOME", str(hf_home))
    for name in TOKEN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return hf_home


@pytest.fixture
def restore_secrets() -> Iterator[None]:
    """Undo what a test adds to the remembered secrets, so one test's token cannot scrub another's text."""
    saved = set(KNOWN_SECRETS)
    yield
    KNOWN_SECRETS.clear()
    KNOWN_SECRETS.update(saved)
