"""A shipped config as a file to edit (`speedtronic init`): each setting followed by its field's
description, the file's own comments kept at the top, and the run named after the file written.

Above the schema (it reads the fields' descriptions) and the starters (it reads the shipped text);
speedtronic.starters itself stays below the config package, which loads shipped configs through it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from speedtronic.config.schema import RUN_NAME_PATTERN, Config
from speedtronic.config.strict_yaml import parse_yaml
from speedtronic.starters import starters


def run_name_for(path: Path, fallback: str) -> str:
    """The run name a config written to `path` gets: the file's stem (`mine.yaml` → `mine`), made a
    valid run name (other characters become '-'); `fallback` when nothing of the stem is left."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem).lstrip("._-")
    return stem if stem and re.match(RUN_NAME_PATTERN, stem) else fallback


def commented_copy(name: str, run_name: str | None = None) -> str:
    """The shipped config `name` in block style, each setting followed by its field's description, with
    the file's own comments kept at the top: loads to the same config as the shipped file, except for
    `run.name` when `run_name` is given (`init` names the run after the file it writes, so a copy
    trains as a run of its own instead of resuming the shipped config's)."""
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
        lines += _block(values, _section_model(field.annotation if field else None), "  ")
    return "\n".join(lines).rstrip() + "\n"


def _section_model(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _block(values: dict[str, Any], model: type[BaseModel] | None, indent: str) -> list[str]:
    """The lines of one section's mapping; a subsection (distributed.sync, …) as a nested block."""
    fields = model.model_fields if model is not None else {}
    flat = {k: v for k, v in values.items() if not (isinstance(v, dict) and _sub(fields, k))}
    width = max((len(f"{indent}{key}: {_flow(value)}") for key, value in flat.items()), default=0)
    lines = []
    for key, value in values.items():
        info = fields.get(key)
        sub = _sub(fields, key)
        if isinstance(value, dict) and sub is not None:
            lines.append(f"{indent}{key}:" + _comment(info.description if info else None))
            lines += _block(value, sub, indent + "  ")
            continue
        text = f"{indent}{key}: {_flow(value)}"
        lines.append(text.ljust(width) + _comment(info.description if info else None))
    return lines


def _sub(fields: dict[str, Any], key: str) -> type[BaseModel] | None:
    info = fields.get(key)
    return _section_model(info.annotation) if info is not None else None


def _flow(value: Any) -> str:
    dumped = yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False).strip()
    return dumped.removesuffix("...").strip()


def _comment(description: str | None) -> str:
    if not description:
        return ""
    return "  # " + " ".join(description.split())
