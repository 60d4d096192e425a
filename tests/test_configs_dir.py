"""Every shipped example config under configs/ validates, keeps what it says, and round-trips."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from speedtronic.config import ALIASES, config_to_yaml, dump_config, load_config

pytestmark = pytest.mark.usefixtures("isolated_env", "restore_secrets")

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))


def test_the_configs_directory_is_not_empty() -> None:
    assert CONFIG_DIR.is_dir(), CONFIG_DIR
    assert CONFIGS, f"no *.yaml under {CONFIG_DIR}"


@pytest.mark.parametrize("path", CONFIGS, ids=[path.name for path in CONFIGS])
def test_example_config_validates_and_keeps_its_values(path: Path, tmp_path: Path) -> None:
    cfg = load_config(path)
    written = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    dumped = dump_config(cfg)
    for dotted, value in _leaves(written):
        node = dumped
        for part in ALIASES.get(dotted, dotted).split("."):
            node = node[part]
        assert node == value, f"{path.name}: {dotted}"
    again = tmp_path / path.name
    again.write_text(config_to_yaml(cfg), encoding="utf-8")
    assert load_config(again) == cfg


def _leaves(written: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted.key, value) for every setting the file spells out, a subsection's (distributed.sync) key
    by key; top-level aliases map to their target."""
    leaves: list[tuple[str, Any]] = []
    for name, values in written.items():
        if isinstance(values, dict) and values and name != "compile":
            leaves += _leaves(values, f"{prefix}{name}.")
        elif prefix or name in ALIASES:
            leaves.append((f"{prefix}{name}", values))
    return leaves
