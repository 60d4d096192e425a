"""Helpers shared by the command modules: the console, `--set`/`--json` options, config loading.

Nothing here imports torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from speedtronic.engine.logs import run_console
from speedtronic.secrets import scrub

if TYPE_CHECKING:
    from pydantic import BaseModel

# Human output goes to stderr so that stdout carries only results (and the --json line). It is the
# run's console too (engine/logs.py), so nothing printed here lands on a progress bar's line.
console: Console = run_console()


def complete_set_key(incomplete: str) -> list[tuple[str, str]]:
    """Shell completion of `--set`: every config field as `section.field=`, with its description."""
    if "=" in incomplete:
        return []
    from speedtronic.config.schema import SECTIONS, Config

    keys: list[tuple[str, str]] = []
    for name, field in Config.model_fields.items():
        section = SECTIONS.get(name)
        if section is None:  # a root flag such as gradient_checkpointing
            keys.append((f"{name}=", field.description or ""))
            continue
        keys += _field_keys(section, f"{name}.")
    return [(key, help_) for key, help_ in keys if key.startswith(incomplete)]


def _field_keys(section: type[BaseModel], prefix: str) -> list[tuple[str, str]]:
    """`prefix.field=` for every field of `section`, a subsection's (distributed.sync) field by field."""
    from pydantic import BaseModel

    keys: list[tuple[str, str]] = []
    for key, sub in section.model_fields.items():
        inner = sub.annotation
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            keys += _field_keys(inner, f"{prefix}{key}.")
        else:
            keys.append((f"{prefix}{key}=", sub.description or ""))
    return keys


SetOption = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="Override a config value before validation: --set optimizer.lr=3e-4 (value parsed as YAML).",
        metavar="KEY=VALUE",
        autocompletion=complete_set_key,
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object as the last line of stdout.")]
ConfigArgument = Annotated[
    Path,
    typer.Argument(
        help="A run config: a YAML file, or the name of a shipped one (shakespeare, smoke; see "
        "`speedtronic configs`).",
        show_default=False,
        metavar="CONFIG",
    ),
]


# Whether this command has printed its JSON line (cli.main adds an error object only when it has not).
json_emitted = False


def emit_json(payload: Any) -> None:
    """Print one JSON object on one stdout line (scrubbed of secrets)."""
    global json_emitted
    json_emitted = True
    sys.stdout.write(scrub(json.dumps(payload, default=str)) + "\n")
    sys.stdout.flush()


def load_cli_config(path: Path, sets: list[str] | None, extra: list[str] = ()) -> Any:
    """Load a config for a command: the file, then `--set` overrides, then the command's own flags."""
    from speedtronic.config import load_config

    return load_config(path, [*(sets or []), *extra])
