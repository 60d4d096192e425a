"""`speedtronic plugins`: list installed plugins, their versions, hooks and what they register."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from speedtronic.cli.common import JsonOption, emit_json


def plugins(
    all_: Annotated[bool, typer.Option("--all", help="Include the core's built-in plugins.")] = False,
    json_: JsonOption = False,
) -> None:
    """List plugins with version, implemented hooks and registered names.

    Example: `speedtronic plugins --all --json`.
    """
    from speedtronic.plugins import get_plugin_host

    listing = get_plugin_host().describe(include_builtin=all_)
    if json_:
        emit_json({"plugins": listing})  # one object, like every command's --json
        return
    if not listing:
        typer.echo("No plugins installed (use --all to list the built-in ones).")
        return
    table = Table("plugin", "version", "hooks", "registers")
    # A plugin's name is never cut ("speedtronic.builtin…" hid which one it is): the other columns wrap.
    table.columns[0].no_wrap = True
    table.columns[0].min_width = max(len(item["name"]) for item in listing)
    for column in table.columns[1:]:
        column.overflow = "fold"
    for item in listing:
        registers = "; ".join(
            f"{kind}: {', '.join(names)}" for kind, names in item["registers"].items() if names
        )
        table.add_row(item["name"], item["version"] or "-", ", ".join(item["hooks"]), registers or "-")
    from rich.console import Console

    Console().print(table)


def register(app: typer.Typer) -> None:
    app.command("plugins", rich_help_panel="Configuration")(plugins)
