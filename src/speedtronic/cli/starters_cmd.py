"""`speedtronic configs` and `speedtronic init NAME [PATH]`: the starter configs shipped in the package.

`speedtronic train shakespeare` trains a shipped config by name from any directory; `init` writes a
copy with every field explained, to edit and train as a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from speedtronic.cli.common import JsonOption, console, emit_json
from speedtronic.errors import ConfigError


def configs(json_: JsonOption = False) -> None:
    """List the starter configs shipped with speedtronic.

    Example: `speedtronic configs` then `speedtronic train smoke` or `speedtronic init shakespeare`.
    """
    from speedtronic.starters import starters

    found = starters()
    if json_:
        listed = [
            {"name": s.name, "description": s.description, "needs_plugin": s.needs_plugin}
            for s in found.values()
        ]
        emit_json({"configs": listed})  # one object, like every command's --json
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "what it is", "needs")
    for s in found.values():
        table.add_row(s.name, s.description, s.needs_plugin or "-")
    Console().print(table)
    console.print("train one with `speedtronic train NAME`; copy one to edit with `speedtronic init NAME`")


def init(
    name: Annotated[
        str, typer.Argument(help="A shipped config (see `speedtronic configs`).", metavar="NAME")
    ],
    path: Annotated[
        Path | None,
        typer.Argument(
            help="Where to write it (a file, or a directory for NAME.yaml in it). Default: ./NAME.yaml.",
            metavar="PATH",
            show_default=False,
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite PATH if it exists.")] = False,
    json_: JsonOption = False,
) -> None:
    """Write a commented copy of a shipped config to edit.

    Example: `speedtronic init shakespeare my.yaml && speedtronic train my.yaml`.
    """
    from speedtronic.atomic_files import atomic_write_bytes
    from speedtronic.config.init_copy import commented_copy, run_name_for
    from speedtronic.starters import starters

    found = starters()
    if name.removesuffix(".yaml") not in found:
        from speedtronic.starters import closest_starter

        close = closest_starter(name)
        meant = f"did you mean {close}? " if close else ""
        raise ConfigError(f"no shipped config named {name!r}; {meant}pick one of: {', '.join(found)}")
    name = name.removesuffix(".yaml")
    target = Path(f"{name}.yaml") if path is None else path
    if target.is_dir():
        target = target / f"{name}.yaml"
    if target.exists() and not force:
        raise ConfigError(f"{target} already exists; pass --force to overwrite it, or give another PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    # The run is named after the file: `init shakespeare mine.yaml` then `train mine.yaml` is a run of
    # its own (runs/mine), not a resume of an earlier `train shakespeare`.
    run_name = run_name_for(target, name)
    atomic_write_bytes(target, commented_copy(name, run_name).encode("utf-8"))
    if json_:
        emit_json({"name": name, "path": str(target), "run_name": run_name})
        return
    console.print(
        f"wrote {target} (run.name: {run_name}, a run of its own): edit it, then "
        f"`speedtronic train {target}`",
        soft_wrap=True,
    )


def register(app: typer.Typer) -> None:
    app.command("configs", rich_help_panel="Configuration")(configs)
    app.command("init", rich_help_panel="Configuration")(init)
