"""`speedtronic data prepare TEXT --out DIR`: tokenise a corpus once into memory-mapped token files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from speedtronic.cli.common import JsonOption, console, emit_json

data_app = typer.Typer(help="Prepare training data.", no_args_is_help=True)


@data_app.command("prepare")
def prepare(
    text: Annotated[Path, typer.Argument(help="A UTF-8 text file.")],
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Output directory (train.bin, val.bin, meta.json).")
    ],
    tokenizer: Annotated[
        str | None, typer.Option("--tokenizer", help="byte (default) or a Hugging Face tokenizer.json path.")
    ] = None,
    val_fraction: Annotated[
        float,
        typer.Option(
            "--val-fraction", min=0.0, max=0.99, help="Share of the tokens (the last) held out as val.bin."
        ),
    ] = 0.1,
    json_: JsonOption = False,
) -> None:
    """Tokenise TEXT incrementally (constant memory) into uint16/uint32 token files for `data.dataset`."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from speedtronic.engine.data import prepare_dataset

    with Progress(
        "[bold]tokenising",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as progress:
        task = progress.add_task("prepare", total=None)

        def report(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        meta = prepare_dataset(text, out, tokenizer=tokenizer, val_fraction=val_fraction, progress=report)
    if json_:
        emit_json({"out": str(out), **meta})
    else:
        console.print(f"[green]✓[/green] wrote {out}: {meta}")


def register(app: typer.Typer) -> None:
    app.add_typer(data_app, name="data", rich_help_panel="Training")
