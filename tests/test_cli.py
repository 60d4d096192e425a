"""The `speedtronic` CLI: version, `validate` (text and --json), exit codes, secret hygiene in real
processes, `plugins`, and keeping torch out of the light commands."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

import speedtronic
from speedtronic.cli import main
from speedtronic.cli.app import build_app
from speedtronic.config import REDACTED, load_config
from speedtronic.plugins import reset_plugin_host

pytestmark = pytest.mark.usefixtures("isolated_env", "restore_secrets")

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "smoke.yaml"
HF_SECRET = "hf_secretTOKENvalue1234567890"
PLAIN_SECRET = "plainSecretCliValue424242"  # not shaped like an HF token: only remembering can scrub it


@pytest.fixture(scope="module")
def app() -> Any:
    return build_app()


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("COLUMNS", "1000")
    return CliRunner()


def call_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the console-script entry point in-process: (exit code, stdout, stderr)."""
    try:
        main(argv)
        code: Any = 0
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return int(code or 0), out, err


# ----------------------------------------------------------------------------------- version, validate


def test_version(app: Any, runner: CliRunner) -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"speedtronic {speedtronic.__version__}"


def test_validate_prints_yaml_that_loads_back(app: Any, runner: CliRunner) -> None:
    result = runner.invoke(app, ["validate", str(SMOKE)])
    assert result.exit_code == 0, result.output
    printed = yaml.safe_load(result.stdout)
    assert isinstance(printed, dict)
    assert load_config(printed) == load_config(SMOKE)
    assert printed["scheduler"]["warmup_steps"] is None  # unset: derived, in the plan section below it
    plan_lines = result.stdout.split("# --- run plan")[1].splitlines()[1:]
    plan = yaml.safe_load("\n".join(line.removeprefix("# ") for line in plan_lines))
    assert plan["schedule_steps"] == 30 and plan["stop_step"] == 30 and plan["vocab_size"] == 256
    assert "is valid" in result.stderr and "is valid" not in result.stdout


def test_validate_applies_set_overrides(app: Any, runner: CliRunner) -> None:
    result = runner.invoke(app, ["validate", str(SMOKE), "--set", "optimizer.lr=0.5", "-s", "batch_size=4"])
    assert result.exit_code == 0, result.output
    printed = yaml.safe_load(result.stdout)
    assert printed["optimizer"]["lr"] == 0.5 and printed["data"]["micro_batch_size"] == 4


def test_validate_json_is_the_last_stdout_line(app: Any, runner: CliRunner) -> None:
    result = runner.invoke(app, ["validate", str(SMOKE), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert isinstance(payload, dict) and payload["valid"] is True
    assert payload["config"]["run"]["name"] == "smoke"
    assert payload["config"]["data"]["target_batch_size"] is None  # as written
    assert payload["plan"]["global_batch_size"] == 8 and payload["plan"]["accum_steps"] == 1


def test_invalid_value_exits_2_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = call_main(["validate", str(SMOKE), "--set", "optimizer.lr=abc"], capsys)
    assert code == 2
    assert "optimizer.lr" in err and err.startswith("error:")
    assert out == ""


def test_unknown_key_exits_2_with_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = call_main(["validate", str(SMOKE), "--set", "optimizer.lrr=0.1"], capsys)
    assert code == 2
    assert "optimizer.lrr" in err and "did you mean 'optimizer.lr'" in err


def test_missing_file_exits_2_in_a_real_process(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    result = run_cli("validate", "does-not-exist.yaml")
    assert result.returncode == 2
    assert "does-not-exist.yaml" in result.stderr and "not found" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "argv",
    [["validate", str(SMOKE), "--no-such-option"], ["no-such-command"], ["validate"], ["plugins", "--bogus"]],
)
def test_usage_errors_exit_2(app: Any, runner: CliRunner, argv: list[str]) -> None:
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output


def test_help_lists_the_commands(app: Any, runner: CliRunner) -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("train", "validate", "plugins"):
        assert command in result.stdout


# ----------------------------------------------------------------------------------------- secrets


@pytest.mark.parametrize("secret", [HF_SECRET, PLAIN_SECRET])
@pytest.mark.parametrize("source", ["env", "set"])
@pytest.mark.parametrize("mode", ["text", "json", "failing"])
def test_token_never_printed_by_validate(
    run_cli: Callable[..., Any], secret: str, source: str, mode: str
) -> None:
    env = {"HF_TOKEN": secret} if source == "env" else {}
    args: list[str] = ["validate", str(SMOKE)]
    if source == "set":
        args += ["--set", f"distributed.bus.token={secret}"]
    if mode == "json":
        args.append("--json")
    if mode == "failing":
        args += ["--set", f"run.device={secret}", "--set", f"run.max_steps={secret}"]
    result = run_cli(*args, env=env)
    assert secret not in result.stdout
    assert secret not in result.stderr
    if mode == "failing":
        assert result.returncode == 2, result.stderr
        assert "run.device" in result.stderr and "run.max_steps" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    if mode == "json":
        payload = json.loads(result.stdout.strip().splitlines()[-1])
        assert (
            payload["config"]["distributed"]["bus"]["token"] == REDACTED
        )  # the token was seen, then redacted
    else:
        assert yaml.safe_load(result.stdout)["distributed"]["bus"]["token"] == REDACTED


def test_token_not_echoed_by_a_usage_error(run_cli: Callable[..., Any]) -> None:
    """`--set distributed.bus.token $HF_TOKEN` (a space instead of '='): click reports the stray argument."""
    result = run_cli(
        "validate", SMOKE, "--set", "distributed.bus.token", HF_SECRET, env={"HF_TOKEN": HF_SECRET}
    )
    assert result.returncode == 2
    assert HF_SECRET not in result.stdout
    assert HF_SECRET not in result.stderr


# ------------------------------------------------------------------------------------ no torch import


NO_TORCH_SCRIPT = """
import sys
from typer.testing import CliRunner
from speedtronic.cli import build_app
app = build_app()
runner = CliRunner()
codes = [runner.invoke(app, args).exit_code for args in (["--help"], ["validate", "--help"], ["train", "--help"])]
print("torch-after-help", sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
codes += [runner.invoke(app, args).exit_code for args in (["validate", sys.argv[1]], ["validate", sys.argv[1], "--json"])]
print("codes", codes)
"""


def test_help_does_not_import_torch(run_cli: Callable[..., Any]) -> None:
    """`--help` stays instant; `validate` may import torch, since its plan probes this machine's device."""
    result = run_cli(SMOKE, python_code=NO_TORCH_SCRIPT)
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.strip().splitlines())
    assert lines["codes"] == "[0, 0, 0, 0, 0]"
    assert lines["torch-after-help"] == "[]"


# ----------------------------------------------------------------------------------------- plugins


@pytest.fixture
def fresh_plugin_host() -> Iterator[None]:
    reset_plugin_host()
    yield
    reset_plugin_host()


@pytest.mark.usefixtures("fresh_plugin_host")
def test_plugins_json_lists_installed_plugins_only(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = runner.invoke(build_app(), ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    listing = json.loads(result.stdout.strip().splitlines()[-1])["plugins"]
    assert isinstance(listing, list)
    assert all(not item["builtin"] for item in listing)
    reset_plugin_host()
    monkeypatch.setenv("SPEEDTRONIC_LOAD_PLUGINS", "")  # load no installed plugin at all
    result = runner.invoke(build_app(), ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"plugins": []}


@pytest.mark.usefixtures("fresh_plugin_host")
def test_plugins_all_json_includes_the_builtins(runner: CliRunner) -> None:
    result = runner.invoke(build_app(), ["plugins", "--all", "--json"])
    assert result.exit_code == 0, result.output
    listing = json.loads(result.stdout.strip().splitlines()[-1])["plugins"]
    by_name = {item["name"]: item for item in listing}
    expected = {
        "speedtronic.builtin.models": ("register_models", "models", ["transformer"]),
        "speedtronic.builtin.optimizers": (
            "register_optimizers",
            "optimizers",
            ["adamw", "muon", "muon_plus"],
        ),
        "speedtronic.builtin.hooks": ("register_hooks", "hooks", ["jsonl", "tensorboard", "wandb"]),
    }
    for name, (hook, kind, registered) in expected.items():
        item = by_name[name]
        assert item["builtin"] is True
        assert hook in item["hooks"]
        assert sorted(item["registers"][kind]) == registered


@pytest.mark.usefixtures("fresh_plugin_host")
def test_plugins_table_names_the_builtins(runner: CliRunner) -> None:
    result = runner.invoke(build_app(), ["plugins", "--all"])
    assert result.exit_code == 0, result.output
    assert "speedtronic.builtin.models" in result.stdout and "transformer" in result.stdout
