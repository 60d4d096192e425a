"""`mkdocs build --strict` passes: every page in the nav exists, every link and anchor resolves, and
the snippets included from the repository (the example plugin's files) are there. The source inventory,
which is not committed, is rendered by the build (scripts/mkdocs_hooks.py).

The `dev` extra installs mkdocs-material, so this runs in CI; it skips only where mkdocs is absent.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason='mkdocs-material is not installed (pip install -e ".[docs]")',
)
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            "mkdocs.yml",
            "--site-dir",
            str(site),
        ],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (site / "index.html").exists()
    assert (site / "reference" / "config" / "index.html").exists()
    plugin_page = (site / "guides" / "plugins" / "index.html").read_text(encoding="utf-8")
    assert "--8&lt;--" not in plugin_page and "register_models" in plugin_page  # snippets were included
    inventory = (site / "reference" / "source" / "index.html").read_text(encoding="utf-8")
    assert "speedtronic.engine" in inventory and "src/speedtronic/__init__.py" in inventory
