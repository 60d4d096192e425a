"""`speedtronic train CONFIG`: a full training run with progress, checkpoints and a JSON summary."""

from __future__ import annotations

from typing import Annotated

import typer

from speedtronic.cli.common import ConfigArgument, JsonOption, SetOption, emit_json, load_cli_config


def train(
    config: ConfigArgument,
    set_: SetOption = None,
    max_steps: Annotated[
        int | None,
        typer.Option(
            "--max-steps",
            min=1,
            help="Stop after this step (a checkpoint is saved); the LR schedule still follows run.max_steps, "
            "so a later --resume continues the same run.",
        ),
    ] = None,
    resume: Annotated[
        bool | None,
        typer.Option(
            "--resume/--no-resume",
            help="Continue from the latest checkpoint / start fresh. Default: resume when one exists.",
            show_default=False,
        ),
    ] = None,
    device: Annotated[str | None, typer.Option("--device", help="auto, cpu, cuda, cuda:N or mps.")] = None,
    json_: JsonOption = False,
) -> None:
    """Train a model as the config says; --json prints steps, tokens, losses, throughput and checkpoint."""
    extra = []
    if device is not None:
        extra.append(f"run.device={device}")
    if resume is not None:
        extra.append(f"checkpoint.resume={str(resume).lower()}")
    cfg = load_cli_config(config, set_, extra)

    from speedtronic.engine.logs import setup_logging
    from speedtronic.engine.trainer import Trainer

    setup_logging(cfg.logging.level, cfg.logging.file)
    result = Trainer(cfg).train(max_steps=max_steps)
    if json_:
        emit_json(result.as_dict())
    else:
        val = f" · val loss {result.val_loss:.4f}" if result.val_loss is not None else ""
        loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "n/a"
        typer.echo(
            f"{'interrupted' if result.interrupted else 'done'}: step {result.steps} · loss {loss}{val} · "
            f"{result.tokens_per_s:,.0f} tok/s · {result.elapsed_s:.1f}s · checkpoint {result.checkpoint or 'none'}"
        )
    if result.interrupted:
        raise typer.Exit(130)


def register(app: typer.Typer) -> None:
    app.command("train", rich_help_panel="Training")(train)
