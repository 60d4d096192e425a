"""Starter configs shipped inside the package: `speedtronic train shakespeare` works from any directory.

The YAML files live in `speedtronic/resources/configs/` (the clone's `configs/` holds the same files,
checked by tests/test_starters.py). A config argument that is not an existing file but names a shipped
config (`shakespeare`, `shakespeare.yaml`, or the clone-relative `configs/shakespeare.yaml`) resolves to
it; `speedtronic init NAME [PATH]` writes a copy with every field explained, to edit.

Must never import torch: it runs under `--help`, `validate` and shell completion.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

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


def run_name_for(path: Path, fallback: str) -> str:
    """The run name a config written to `path` gets: the file's stem (`mine.yaml` → `mine`), made a
    valid run name (other characters become '-'); `fallback` when nothing of the stem is left."""
    import re

    from speedtronic.config.schema import RUN_NAME_PATTERN

    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem).lstrip("._-")
    return stem if stem and re.match(RUN_NAME_PATTERN, stem) else fallback


def commented_copy(name: str, run_name: str | None = None) -> str:
    """The shipped config `name` in block style, each setting followed by its field's description, with
    the file's own comments kept at the top: loads to the same config as the shipped file, except for
    `run.name` when `run_name` is given (`init` names the run after the file it writes, so a copy
    trains as a run of its own instead of resuming the shipped config's)."""
    from speedtronic.config.schema import Config
    from speedtronic.config.strict_yaml import parse_yaml

    starter = starters()[name]
    raw: dict[str, Any] = parse_yaml(starter.text, f"shipped config {name}") or {}
    if run_name is not None:
        raw["run"] = {"name": run_name, **{k: v for k, v in (raw.get("run") or {}).items() if k != "name"}}
    header = [line for line in starter.text.splitlines() if line.startswith("#")]
    lines = [
        *header,
        f"# Written by `speedtronic init {name}`: edit it, then `speedtronic train THIS_FILE`.",
        "# Every field not written here has a default: `speedtronic validate THIS_FILE` prints them all,",
        "# and `--set section.field=value` overrides any of them for one run.",
        "",
    ]
    for section, values in raw.items():
        field = Config.model_fields.get(section)
        if not isinstance(values, dict) or section == "compile":
            lines.append(f"{section}: {_flow(values)}" + _comment(field.description if field else None))
            continue
        lines.append(f"{section}:")
        model = getattr(field, "annotation", None) if field else None
        subfields = getattr(model, "model_fields", {})
        width = max(len(f"  {key}: {_flow(value)}") for key, value in values.items())
        for key, value in values.items():
            text = f"  {key}: {_flow(value)}"
            info = subfields.get(key)
            lines.append(text.ljust(width) + _comment(info.description if info else None))
    return "\n".join(lines).rstrip() + "\n"


def _flow(value: Any) -> str:
    dumped = yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False).strip()
    return dumped.removesuffix("...").strip()


def _comment(description: str | None) -> str:
    if not description:
        return ""
    return "  # " + " ".join(description.split())
