"""`speedtronic eval CHECKPOINT`: is the model any good? Bits per byte on text, accuracy on tasks.

The work is engine/evaluate.py's (scoring) and speedtronic/eval_tasks.py's (task files, statistics);
this module parses options, checks task files before the model is loaded, shows a progress bar on
a terminal and prints a table or the `--json` object.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from speedtronic.cli.common import JsonOption, console, emit_json


def eval_command(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            help="A step_*.pt file, a sharded step_*.dcp folder, or a checkpoint directory (its latest).",
            metavar="CHECKPOINT",
            show_default=False,
        ),
    ],
    data: Annotated[
        str | None,
        typer.Option(
            "--data",
            "-d",
            help="Text to score (loss, perplexity, bits per byte): a text file, a folder, a glob, JSONL or "
            "Parquet as `data prepare` reads them, or a prepared dataset (its validation split).",
            metavar="PATH",
        ),
    ] = None,
    task: Annotated[
        list[str] | None,
        typer.Option(
            "--task",
            help="A task file (.jsonl), a suite (.yaml) or a shipped one by name (shakespeare-cloze, "
            "shakespeare-next-line, shakespeare); repeatable.",
            metavar="TASK",
        ),
    ] = None,
    max_tokens: Annotated[
        int,
        typer.Option("--max-tokens", min=0, help="Tokens of --data scored at most (0: all of it)."),
    ] = 1_000_000,
    batch_size: Annotated[
        int, typer.Option("--batch-size", "-b", min=1, help="Sequences per forward pass.")
    ] = 16,
    text_field: Annotated[
        str, typer.Option("--text-field", help="The text field of JSONL records and Parquet rows.")
    ] = "text",
    device: Annotated[
        str, typer.Option("--device", help="auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps.")
    ] = "auto",
    json_: JsonOption = False,
) -> None:
    """Score a checkpoint: loss, perplexity and bits per byte on text, accuracy on tasks.

    Example: `speedtronic eval runs/shakespeare/checkpoints --task shakespeare --data held-out.txt`.
    """
    from speedtronic.errors import ConfigError
    from speedtronic.eval_tasks import load_tasks

    if data is None and not task:
        raise ConfigError("speedtronic eval: give --data PATH (text to score) and/or --task TASK (or both)")
    tasks = load_tasks(task or [])  # a bad task file fails before the model is loaded

    from speedtronic.engine.evaluate import evaluate_checkpoint
    from speedtronic.plugins import registries

    with _progress_bar(enabled=not json_) as progress:
        report = evaluate_checkpoint(
            checkpoint,
            data=data,
            tasks=tasks,
            max_tokens=max_tokens or None,
            batch_size=batch_size,
            device=device,
            text_field=text_field,
            registries=registries(),
            progress=progress,
        )
    if json_:
        emit_json(report)
    else:
        print_report(report)


class _progress_bar:
    """A rich bar per phase (data, each task) on a terminal's stderr; nothing elsewhere."""

    def __init__(self, enabled: bool) -> None:
        self.live = enabled and console.is_terminal
        self.bar: Any = None
        self.phases: dict[str, Any] = {}

    def __enter__(self) -> Any:
        if not self.live:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        )
        self.bar.start()
        return self.update

    def update(self, phase: str, done: int, total: int) -> None:
        if phase not in self.phases:
            self.phases[phase] = self.bar.add_task(phase, total=total)
        self.bar.update(self.phases[phase], completed=done)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def print_report(report: dict[str, Any]) -> None:
    """The human view: one line for the data, a table of the tasks with the aggregate."""
    from rich.console import Console
    from rich.table import Table

    out = Console(width=None if Console().is_terminal else 120)
    out.print(f"checkpoint {report['checkpoint']} (step {report['step']})", highlight=False, soft_wrap=True)
    scored = report.get("data")
    if scored:
        if scored["loss"] is None:
            out.print(f"data {scored['path']}: nothing to score (no document longer than one token)")
        else:
            out.print(
                f"data {scored['path']}: loss {scored['loss']:.4f} · perplexity {scored['perplexity']:.3f} · "
                f"{scored['bits_per_byte']:.4f} bits per byte · {scored['tokens']:,} tokens, "
                f"{scored['bytes']:,} bytes, {scored['documents']:,} documents",
                highlight=False,
                soft_wrap=True,  # one line, whatever the width: scripts grep it
            )
    tasks = report.get("tasks") or {}
    if not tasks:
        return
    table = Table("task", "n", "metric", "accuracy", "± stderr", "acc", "acc_norm", "chance", "centred")
    for name, r in tasks.items():
        table.add_row(
            name,
            f"{r['n']:,}",
            r["metric"],
            f"{r['accuracy']:.4f}",
            "-" if r["stderr"] is None else f"{r['stderr']:.4f}",
            f"{r['acc']:.4f}" if "acc" in r else "-",
            f"{r['acc_norm']:.4f}" if "acc_norm" in r else "-",
            f"{r['chance']:.4f}",
            f"{r['centred']:+.4f}",
        )
    core = report["accuracy"].get("aggregate")
    table.add_row("aggregate (CORE)", "", "centred", "", "", "", "", "", f"{core:+.4f}")
    out.print(table)


def register(app: typer.Typer) -> None:
    app.command("eval", rich_help_panel="Training")(eval_command)
