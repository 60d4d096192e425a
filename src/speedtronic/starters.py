"""Starter configs shipped inside the package: `speedtronic train shakespeare` works from any directory.

The YAML files live in `speedtronic/resources/configs/` (the clone's `configs/` holds the same files,
checked by tests/test_starters.py). A config argument that is not an existing file but names a shipped
config (`shakespeare`, `shakespeare.yaml`, or the clone-relative `configs/shakespeare.yaml`) resolves to
it; `speedtronic init NAME [PATH]` writes a copy with every field explained (config/init_copy.py).

Below the config package: the loader reads shipped configs through it, so it never imports the schema.
Must never import torch: it runs under `--help`, `validate` and shell completion.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

PACKAGE = "speedtronic.resources"
FOLDER = "configs"


@dataclass(frozen=True)
class Starter:
    name: str  # "shakespeare"
    text: str  # the file as shipped
    description: str  # its first comment sentence

    @property
    def needs_plugin(self) -> str | None:
        """The plugin distribution this config needs, if it says so (`pip install -e plugins/NAME`)."""
        for line in self.text.splitlines():
            if "plugins/speedtronic-" in line and "pip install" in line:
                return "speedtronic-" + line.split("plugins/speedtronic-", 1)[1].split()[0].rstrip(")`")
        return None


def starters() -> dict[str, Starter]:
    """Every shipped config by name, sorted."""
    folder = resources.files(PACKAGE).joinpath(FOLDER)
    found: dict[str, Starter] = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            text = entry.read_text(encoding="utf-8")
            found[entry.name[: -len(".yaml")]] = Starter(entry.name[:-5], text, _description(text))
    return found


def _description(text: str) -> str:
    comment = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        comment.append(line.lstrip("#").strip())
    first = " ".join(comment)
    return first.split(". ")[0].rstrip(".") if first else ""


def starter_name(argument: str | Path) -> str | None:
    """The shipped config `argument` names, or None. An existing file always wins over a name."""
    path = Path(argument)
    if path.exists():
        return None
    names = starters()
    parts = path.parts
    # `configs/shakespeare.yaml` as the README of a clone says it, run outside the clone.
    if len(parts) == 2 and parts[0] == "configs":
        parts = parts[1:]
    if len(parts) != 1:
        return None
    name = parts[0][: -len(".yaml")] if parts[0].endswith(".yaml") else parts[0]
    return name if name in names else None


def closest_starter(argument: str | Path) -> str | None:
    """The shipped config a mistyped name most likely meant (`smok` → `smoke`), or None."""
    import difflib

    name = Path(argument).name
    name = name[: -len(".yaml")] if name.endswith(".yaml") else name
    found = difflib.get_close_matches(name, list(starters()), n=1, cutoff=0.6)
    return found[0] if found else None


def starter_text(name: str) -> str:
    return starters()[name].text
