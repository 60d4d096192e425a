"""`speedtronic validate CONFIG`: load, override and validate a config; print it with secrets redacted."""

from __future__ import annotations

import typer

from speedtronic.cli.common import ConfigArgument, JsonOption, SetOption, console, emit_json, load_cli_config


def validate(config: ConfigArgument, set_: SetOption = None, json_: JsonOption = False) -> None:
    """Validate a config and print the resolved result (derived values filled in, token redacted)."""
    from speedtronic.config import config_to_yaml, dump_config

    cfg = load_cli_config(config, set_)
    check_registered_names(cfg)
    if json_:
        emit_json({"valid": True, "config": dump_config(cfg)})
        return
    typer.echo(config_to_yaml(cfg), nl=False)
    console.print(f"[green]✓[/green] {config} is valid (accumulation steps: {cfg.data.grad_accum_steps})")


def check_registered_names(cfg: object) -> None:
    """Names that select plugins (model, optimizer, hooks) must be registered; no torch is imported."""
    from speedtronic.plugins import registries

    found = registries()
    found.models.get(cfg.model.name)  # type: ignore[attr-defined]
    found.optimizers.get(cfg.optimizer.name)  # type: ignore[attr-defined]
    for hook in cfg.logging.hooks:  # type: ignore[attr-defined]
        found.hooks.get(hook)


def register(app: typer.Typer) -> None:
    app.command("validate", rich_help_panel="Configuration")(validate)
