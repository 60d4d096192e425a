"""The first hour from a plain install: the built wheel, in a fresh venv, outside any clone, trains a
shipped config by name and plots the run as a PNG a person can read.

The venv borrows this environment's third-party packages (torch, rich, matplotlib, …) through a .pth
line, so nothing is downloaded; speedtronic itself comes only from the wheel (no clone on the path).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


def test_the_wheel_trains_a_shipped_config_and_plots_it_outside_the_clone(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["OMP_NUM_THREADS"] = "1"
    # Build from a copy, so setuptools' build/ and egg-info never land in the checkout.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    dist = tmp_path / "dist"
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(dist), str(source)],
        cwd=tmp_path, env=env,
    )  # fmt: skip
    (wheel,) = dist.glob("speedtronic_lm-*.whl")
    home = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(home)
    python = home / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=tmp_path, env=env).stdout.strip())  # fmt: skip
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        cwd=tmp_path, env=env,
    )  # fmt: skip
    speedtronic = home / "bin" / "speedtronic"
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = run([str(python), "-c", "import speedtronic; print(speedtronic.__file__)"], cwd=work, env=env)
    assert str(site) in where.stdout, where.stdout  # the wheel's copy, not a clone's

    listed = json.loads(
        run([str(speedtronic), "configs", "--json"], cwd=work, env=env).stdout.splitlines()[-1]
    )
    assert {"shakespeare", "smoke"} <= {item["name"] for item in listed["configs"]}
    trained = run(
        [str(speedtronic), "train", "shakespeare", "--max-steps", "30", "--json"], cwd=work, env=env
    )
    result = json.loads(trained.stdout.splitlines()[-1])
    assert result["steps"] == 30 and result["final_loss"] < 5.0
    run([str(speedtronic), "runs", "plot", "shakespeare", "--out", "curves.png"], cwd=work, env=env)
    data = (work / "curves.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 600 and height >= 400 and len(data) > 10_000
