"""The DiLoCo command surface: master, worker and the hub group exist with their documented options,
and usage mistakes exit 2 with the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from speedtronic.cli.app import build_app

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"


@pytest.mark.parametrize(
    ("argv", "options"),
    [
        (["master"], ["--repo", "--endpoint", "--no-train", "--outer-steps", "--json", "--set"]),
        (["worker"], ["--repo", "--node-id", "--endpoint", "--json", "--set"]),
        (["hub", "init"], ["--config", "--gated", "--private", "--public", "--endpoint", "--json"]),
        (["hub", "add-collaborator"], ["--delta-repo", "--node-id", "--record-only", "--endpoint", "--json"]),
        (["hub", "status"], ["--endpoint", "--json"]),
    ],
)
def test_commands_and_options(argv: list[str], options: list[str]) -> None:
    result = CliRunner().invoke(build_app(with_plugins=False), [*argv, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for option in options:
        assert option in result.output, option


def test_worker_without_a_repo_is_a_usage_error(run_cli) -> None:
    result = run_cli("worker", SMOKE, "--node-id", "w1")
    assert result.returncode == 2
    assert "--repo" in result.stderr and "distributed.bus.repo_id" in result.stderr


def test_hub_init_takes_one_visibility(run_cli) -> None:
    """Gated is the default; --private and --public are the other two, one at a time."""
    result = run_cli("hub", "init", "you/run", SMOKE, "--private", "--public")
    assert result.returncode == 2
    assert "give one of --gated (the default), --private, --public" in result.stderr


def test_a_worker_may_not_take_the_masters_node_id(run_cli, tmp_path) -> None:
    """ "master" is the master's own training node (guarded by the master role lease): refused at once."""
    result = run_cli("worker", SMOKE, "--repo", f"file://{tmp_path / 'bus'}", "--node-id", "master")
    assert result.returncode == 2, result.stderr
    assert "--node-id" in result.stderr and "'master'" in result.stderr
    assert not (tmp_path / "bus").exists()  # refused before touching the bus
