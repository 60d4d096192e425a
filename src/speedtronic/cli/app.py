"""Builds the Typer application: global options, the built-in command groups, and plugin commands."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from speedtronic import __version__


def _version(value: bool) -> None:
    if value:
        typer.echo(f"speedtronic {__version__}")
        raise typer.Exit()


def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Speedtronic: fast language-model training, and DumbDiLoCo sync over the Hugging Face Hub."""


def build_app(*, with_plugins: bool = True) -> typer.Typer:
    """The full command suite; plugins may add commands unless `with_plugins` is false."""
    from speedtronic.cli import (
        checkpoint,
        data,
        diloco_cmd,
        export,
        hub_cmd,
        plugins_cmd,
        sample,
        shapes,
        train,
        validate,
    )

    app = typer.Typer(
        name="speedtronic",
        no_args_is_help=True,
        rich_markup_mode="rich",
        pretty_exceptions_enable=False,  # main() prints errors itself, scrubbed of secrets
        context_settings={"help_option_names": ["-h", "--help"]},
        add_completion=True,
    )
    app.callback()(_root)
    for module in (
        train,
        validate,
        shapes,
        sample,
        export,
        checkpoint,
        data,
        plugins_cmd,
        diloco_cmd,
        hub_cmd,
    ):
        module.register(app)
    if with_plugins:
        from speedtronic.plugins import get_plugin_host

        host = get_plugin_host()
        host.add_commands(app)
        if not os.environ.get("_SPEEDTRONIC_COMPLETE"):  # warnings would garble a shell's completion
            _print_plugin_warnings(host.warnings)
            host.on_warning = lambda warning: _print_plugin_warnings([warning])
    return app


def _print_plugin_warnings(warnings: list[str]) -> None:
    from rich.markup import escape

    from speedtronic.cli.common import console

    for warning in warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}", soft_wrap=True)
