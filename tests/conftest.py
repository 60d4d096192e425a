"""Shared fixtures: running the real CLI in a subprocess, an isolated Hugging Face environment,
restoring the process-wide set of remembered secrets, a DiLoCo swarm of real processes
(tests/swarm_harness.py); and, under pytest-xdist, the longest tests first."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# One compute thread per test process (inherited by the subprocesses tests start): several training
# processes at once on a small machine otherwise spin-wait on each other's cores, many times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import speedtronic
from speedtronic import secrets

if TYPE_CHECKING:
    from swarm_harness import Swarm

SRC_DIR = Path(speedtronic.__file__).resolve().parents[1]
KNOWN_SECRETS: set[str] = secrets._known_secrets  # remembered token values (scrubbed from output)
TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def bench_env() -> dict[str, str]:
    """The environment a bench script runs in as a subprocess: this checkout's src first, no Hub token,
    one thread per process (the benches start many)."""
    env = {k: v for k, v in os.environ.items() if k not in TOKEN_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC_DIR), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


# Test files with the longest tests, longest first (measured on two cores: `--durations` in the CI
# log shows them). The README's test command runs pytest-xdist with `--maxschedchunk 1`: each worker
# takes the next test in collection order as it frees up, so putting the long ones first keeps one
# long test from starting last and running alone at the end. Only the order changes; a stale list
# costs minutes of wall time, never a result.
LONGEST_FIRST = (
    "test_fsdp.py",
    "test_diloco_churn.py",
    "test_diloco_multiprocess.py",
    "test_input_bounds.py",
    "test_docs_blocks.py",
    "test_diloco_swarm.py",
    "test_diloco_hub_swarm.py",
    "test_diloco_hostile_swarm.py",
    "test_interrupts.py",
    "test_diloco_hub_flow.py",
    "test_second_hour.py",
    "test_diloco_attack_suite.py",
    "test_train_cli.py",
    "test_run_plan.py",
    "test_diloco_identity_cli.py",
    "test_diloco_global_guard.py",
    "test_hybrid_optimizer.py",
    "test_ddp.py",
    "test_eval.py",
    "test_diloco_run_end.py",
    "test_diloco_master_standby.py",
    "test_diloco_s3_swarm.py",
    "test_wheel_install.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist (in a worker: it has `workerinput`), the long tests first: LONGEST_FIRST's files in
    its order, then the other `slow` tests, then the rest. A stable sort, so a file's tests keep their
    order; every worker sorts the same collection the same way, as xdist requires. A plain run keeps
    pytest's order."""
    if not hasattr(config, "workerinput"):
        return

    def rank(item: pytest.Item) -> int:
        name = item.path.name
        if name in LONGEST_FIRST:
            return LONGEST_FIRST.index(name)
        return len(LONGEST_FIRST) + (0 if item.get_closest_marker("slow") else 1)

    items.sort(key=rank)


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


@pytest.fixture
def swarm(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Swarm]:
    """A `Swarm` (tests/swarm_harness.py) in tmp_path, closed (its processes killed, its own loopback
    Hub stopped) after the test. The bus is a directory unless the test parametrizes this fixture
    indirectly with a bus name: `@pytest.mark.parametrize("swarm", ["directory", "hub"], indirect=True)`."""
    from swarm_harness import Swarm  # swarm_harness imports this module: not at the top

    s = Swarm(tmp_path, getattr(request, "param", "directory"))
    yield s
    s.close()
