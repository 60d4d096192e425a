"""The distribution's name is ours, and every plugin (the example, which is the template to copy, and
the transformers one) depends on it by that name with a version range."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement  # pytest depends on packaging

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = sorted((ROOT / "plugins").glob("*/pyproject.toml"))


def _project(path: Path) -> dict:
    return tomllib.loads(path.read_text(encoding="utf-8"))["project"]


def test_the_distribution_is_not_the_taken_pypi_name() -> None:
    project = _project(ROOT / "pyproject.toml")
    # PyPI's `speedtronic` (0.1.0, 2.0.0) is another author's project with its own `speedtronic` command.
    assert project["name"] == "speedtronic-lm"
    assert project["scripts"] == {"speedtronic": "speedtronic.__main__:main"}


@pytest.mark.parametrize("path", PLUGINS, ids=[p.parent.name for p in PLUGINS])
def test_plugins_depend_on_our_distribution_with_a_version_range(path: Path) -> None:
    ours = _project(ROOT / "pyproject.toml")
    requirements = [Requirement(text) for text in _project(path)["dependencies"]]
    names = {req.name for req in requirements}
    assert "speedtronic" not in names, f"{path}: `speedtronic` on PyPI is another project"
    (core,) = [req for req in requirements if req.name == ours["name"]]
    operators = {spec.operator for spec in core.specifier}
    assert operators & {">=", "~="} and (operators & {"<", "~="}), f"{path}: {core} is not a range"
    assert core.specifier.contains(ours["version"]), f"{path}: {core} excludes {ours['version']}"
    assert "torch" not in names, f"{path}: naming torch lets pip swap the installed build"


def test_install_hints_name_the_distribution() -> None:
    hints = [
        path for path in (ROOT / "src").rglob("*.py") if "'speedtronic[" in path.read_text(encoding="utf-8")
    ]
    assert not hints, f"pip install 'speedtronic[...]' installs another project: {hints}"
