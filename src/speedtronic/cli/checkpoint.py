"""`speedtronic checkpoint inspect PATH`: what a checkpoint file (or a directory's latest) holds."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from speedtronic.cli.common import JsonOption, emit_json

checkpoint_app = typer.Typer(help="Inspect training checkpoints.", no_args_is_help=True)


@checkpoint_app.command("inspect")
def inspect(
    path: Annotated[
        Path,
        typer.Argument(
            help="A step_*.pt file, or a checkpoint directory (its latest).",
            metavar="CHECKPOINT",
            show_default=False,
        ),
    ],
    json_: JsonOption = False,
) -> None:
    """Show step, tokens, parameters, vocabulary, optimizer, scheduler, precision, data position, config,
    plan and size.

    Example: `speedtronic checkpoint inspect runs/shakespeare/checkpoints --json`.
    """
    from speedtronic.engine.checkpoint.load_run import inspect as inspect_checkpoint

    summary = inspect_checkpoint(path)
    if json_:
        emit_json(summary)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("field", "value", show_header=False)
    for key, value in summary.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        table.add_row(key, str(value))
    Console().print(table)


def register(app: typer.Typer) -> None:
    app.add_typer(checkpoint_app, name="checkpoint", rich_help_panel="Training")
