"""The CLI surface a newcomer meets: every command's --help shows an example, arguments are named in
capitals everywhere, `hub init REPO CONFIG` takes its config like every other command (`--config`
still works), `--set` completes config keys from the schema, and `sample` picks its device like `train`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer.main

from speedtronic.cli.app import build_app


def commands() -> list[tuple[str, Any]]:
    """("hub init", command) for every leaf command (Typer vendors click, so no isinstance checks)."""
    found: list[tuple[str, Any]] = []

    def walk(command: Any, path: str) -> None:
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                walk(sub, f"{path} {name}".strip())
        else:
            found.append((path, command))

    walk(typer.main.get_command(build_app(with_plugins=False)), "")
    return found


COMMANDS = commands()


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[path for path, _ in COMMANDS])
def test_every_command_shows_an_example_and_names_arguments_in_capitals(path: str, command: Any) -> None:
    assert "Example" in (command.help or ""), f"`speedtronic {path} --help` shows no example"
    assert f"`speedtronic {path.split()[0]}" in command.help, f"{path}: the example does not run speedtronic"
    for param in command.params:
        if param.param_type_name == "argument":
            name = (param.metavar or param.name or "").removesuffix("...")
            assert name.isupper(), f"speedtronic {path}: argument {name!r} is not in capitals"


def test_hub_init_takes_config_as_an_argument_and_still_as_an_option(run_cli, tmp_path: Path) -> None:
    positional = run_cli("hub", "init", f"file://{tmp_path / 'bus-a'}", "smoke", "--json")
    assert positional.returncode == 0, positional.stderr
    assert json.loads(positional.stdout.splitlines()[-1])["outer_step"] == 0
    option = run_cli("hub", "init", f"file://{tmp_path / 'bus-b'}", "--config", "smoke", "--json")
    assert option.returncode == 0, option.stderr
    neither = run_cli("hub", "init", f"file://{tmp_path / 'bus-c'}")
    assert neither.returncode == 2 and "REPO CONFIG" in neither.stderr


def test_set_completes_config_keys_from_the_schema(run_cli) -> None:
    env = {
        "_SPEEDTRONIC_COMPLETE": "complete_bash",
        "COMP_WORDS": "speedtronic train smoke --set opt",
        "COMP_CWORD": "4",
    }
    result = run_cli(env=env)
    assert result.returncode == 0, result.stderr
    offered = result.stdout.split()
    assert {"optimizer.lr=", "optimizer.name=", "optimizer.weight_decay="} <= set(offered)
    assert all(key.startswith("optimizer.") for key in offered)


def test_sample_defaults_to_device_auto() -> None:
    command = dict(COMMANDS)["sample"]
    device = next(param for param in command.params if param.name == "device")
    assert device.default == "auto"


def test_flags_show_no_bool_type(run_cli) -> None:
    result = run_cli("train", "--help")
    assert result.returncode == 0, result.stderr
    assert "--json" in result.stdout and "--tensorboard" in result.stdout
    assert "<bool>" not in result.stdout
    assert "<int" in result.stdout  # options that take a value keep their type
