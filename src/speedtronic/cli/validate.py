"""`speedtronic validate CONFIG`: load, override and validate a config; print it with secrets redacted."""

from __future__ import annotations

import typer

from speedtronic.cli.common import ConfigArgument, JsonOption, SetOption, console, emit_json, load_cli_config


def validate(config: ConfigArgument, set_: SetOption = None, json_: JsonOption = False) -> None:
    """Validate a config and print the resolved result (derived values filled in, token redacted)."""
    from speedtronic.config import config_to_yaml, dump_config

    cfg = load_cli_config(config, set_)
    if json_:
        emit_json({"valid": True, "config": dump_config(cfg)})
        return
    typer.echo(config_to_yaml(cfg), nl=False)
    console.print(f"[green]✓[/green] {config} is valid (accumulation steps: {cfg.data.grad_accum_steps})")


def register(app: typer.Typer) -> None:
    app.command("validate", rich_help_panel="Configuration")(validate)
