"""Builds the Typer application: global options, the built-in command groups, and plugin commands."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer
import typer.core

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


def _hide_flag_types() -> None:
    """Typer ≥ 0.24 prints a type column in --help, `<bool>` for every on/off flag; a flag takes no
    value, so show nothing there (options that take a value keep `<int>`, `<path>`, …)."""
    option = getattr(typer.core, "TyperOption", None)
    original = getattr(option, "display_type_rich", None)
    if original is None or getattr(original, "_speedtronic", False):
        return

    def display_type_rich(self: Any, ctx: Any) -> str | None:
        if getattr(self, "is_flag", False) and self.metavar is None:
            return None
        return original(self, ctx)

    display_type_rich._speedtronic = True  # type: ignore[attr-defined]
    option.display_type_rich = display_type_rich  # type: ignore[union-attr]


def build_app(*, with_plugins: bool = True) -> typer.Typer:
    """The full command suite; plugins may add commands unless `with_plugins` is false."""
    _hide_flag_types()
    from speedtronic.cli import (
        checkpoint,
        dashboard_cmd,
        data,
        diloco_cmd,
        eval_cmd,
        export,
        hub_cmd,
        plugins_cmd,
        runs_cmd,
        sample,
        shapes,
        starters_cmd,
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
        runs_cmd,
        dashboard_cmd,
        validate,
        starters_cmd,
        shapes,
        sample,
        eval_cmd,
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
