"""The `register_commands` hook: a plugin's command joins the CLI, is listed, and a failing one is isolated."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import typer
from typer.testing import CliRunner

from speedtronic import hookimpl
from speedtronic.cli.app import build_app
from speedtronic.plugins import PluginHost, get_plugin_host, reset_plugin_host


class Greeter:
    @hookimpl
    def register_commands(self, app: typer.Typer) -> None:
        @app.command("hello")
        def hello(name: str = typer.Option("world", help="Whom to greet.")) -> None:
            """Say hello."""
            typer.echo(f"hello, {name}")


class Broken:
    @hookimpl
    def register_commands(self, app: typer.Typer) -> None:
        raise RuntimeError("no commands today")


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Iterator[PluginHost]:
    """A process-wide host with only the built-ins, restored afterwards."""
    monkeypatch.setenv("SPEEDTRONIC_LOAD_PLUGINS", "")
    monkeypatch.delenv("SPEEDTRONIC_STRICT_PLUGINS", raising=False)
    reset_plugin_host()
    yield get_plugin_host()
    reset_plugin_host()


def test_a_plugin_command_runs_and_is_listed(host: PluginHost) -> None:
    host.register(Greeter(), "greeter")
    app = build_app()
    result = CliRunner().invoke(app, ["hello", "--name", "plugin"])
    assert result.exit_code == 0, result.output
    assert result.output == "hello, plugin\n"
    assert host.infos["greeter"].hooks == ["register_commands"]
    assert host.infos["greeter"].registers["commands"] == ["hello"]


def test_a_failing_register_commands_is_skipped_with_a_warning(host: PluginHost) -> None:
    host.register(Broken(), "broken")
    host.register(Greeter(), "greeter")
    app = build_app()
    assert CliRunner().invoke(app, ["hello"]).output == "hello, world\n"
    assert any("'broken'" in w and "register_commands" in w for w in host.warnings), host.warnings


def test_no_plugin_commands_without_plugins(host: PluginHost) -> None:
    host.register(Greeter(), "greeter")
    result = CliRunner().invoke(build_app(with_plugins=False), ["hello"])
    assert result.exit_code != 0
