"""`speedtronic runs`: a table of the runs under runs/ (from their metrics.jsonl), and
`speedtronic runs plot A B [--out curves.png]`: their loss curves, in the terminal or as an image."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from speedtronic.cli.common import JsonOption, console, emit_json

runs_app = typer.Typer(
    help="Compare runs: a table of every run under runs/, and loss-curve plots.",
    invoke_without_command=True,
    no_args_is_help=False,
)

RootOption = Annotated[
    str, typer.Option("--root", help="The folder holding one sub-folder per run.", show_default=True)
]


@runs_app.callback()
def runs(ctx: typer.Context, root: RootOption = "runs", json_: JsonOption = False) -> None:
    """A table of the runs under runs/: steps, tokens, losses, task CORE score, tok/s, wall time, optimizer, lr.

    Example: `speedtronic runs`, `speedtronic runs --json`, `speedtronic runs plot smoke shakespeare`.
    """
    if ctx.invoked_subcommand is not None:
        return
    folder = Path(root)
    from speedtronic.runs import find_runs

    found = find_runs(folder)
    if json_:
        emit_json({"runs": [run.as_dict() for run in found]})  # one object, like every command's --json
        return
    if not found:
        console.print(f"no runs under {folder} (a run writes {folder}/<name>/metrics.jsonl)")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(
        "run", "steps", "tokens", "loss", "val loss", "best val", "core", "tok/s", "wall", "optimizer", "lr"
    )
    mixtures = any(run.val_by_source for run in found)
    if mixtures:  # data.sources runs: the last val loss of each source
        table.add_column("val by source")
    for run in found:
        by_source = (
            [" ".join(f"{k} {v:.3f}" for k, v in run.val_by_source.items()) or "-"] if mixtures else []
        )
        table.add_row(
            run.name,
            _num(run.steps),
            _num(run.tokens),
            _loss(run.final_loss),
            _loss(run.final_val_loss),
            _loss(run.best_val_loss),
            "-" if run.core is None else f"{run.core:+.3f}",  # run.eval_tasks' CORE aggregate
            _num(run.tokens_per_s),
            _duration(run.wall_s),
            run.optimizer or "-",
            f"{run.lr:g}" if run.lr is not None else "-",
            *by_source,
        )
    terminal = Console()
    # Off a terminal (a pipe, a file) rich assumes 80 columns and would squeeze the table: give it room.
    Console(width=None if terminal.is_terminal else 200).print(table)


@runs_app.command("plot")
def plot(
    names: Annotated[
        list[str] | None,
        typer.Argument(
            help="Runs to plot: names under --root, run folders or metrics files (default: every run).",
            metavar="RUN...",
            show_default=False,
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", help="Write a PNG image here (needs matplotlib) instead of a terminal plot."
        ),
    ] = None,
    val: Annotated[
        bool, typer.Option("--val", help="Terminal plot: validation loss instead of training.")
    ] = False,
    metric: Annotated[
        str | None,
        typer.Option(
            "--metric",
            help="Terminal plot: a run.eval_tasks metric (core, or a task's name) instead of the loss; "
            "an image has a panel for each.",
        ),
    ] = None,
    root: RootOption = "runs",
    json_: JsonOption = False,
) -> None:
    """Plot the loss curves of one or several runs, in the terminal or as an image.

    Example: `speedtronic runs plot smoke shakespeare --out curves.png`.
    """
    from speedtronic.errors import ConfigError
    from speedtronic.runs import find_runs, plot_png, resolve_run, text_plot

    folder = Path(root)
    chosen = [resolve_run(name, folder) for name in names] if names else find_runs(folder)[::-1]
    if not chosen:
        raise ConfigError(f"no runs under {folder} to plot; train one first (speedtronic train smoke)")
    if out is not None:
        plot_png(chosen, out)
        if json_:
            emit_json({"out": str(out), "runs": [run.name for run in chosen]})
        else:
            console.print(f"wrote {out} ({len(chosen)} run{'s' if len(chosen) > 1 else ''})")
        return
    if json_:
        emit_json({"runs": [run.as_dict(curves=True) for run in chosen]})
        return
    typer.echo(text_plot(chosen, val=val, metric=metric))


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def register(app: typer.Typer) -> None:
    app.add_typer(runs_app, name="runs", rich_help_panel="Training")
