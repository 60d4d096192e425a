"""The plugin system end to end, with the example plugin (plugins/speedtronic-example) installed.

Covers discovery through the entry point (`speedtronic plugins --json`), SPEEDTRONIC_LOAD_PLUGINS,
a plugin model training through the registry, isolation of a broken plugin (and strict mode), a plugin
registered directly on the host, and two plugins claiming one name.

The example plugin must be installed (`pip install -e plugins/speedtronic-example`; CI does it): tests
that need it fail, rather than skip, when it is missing, so a broken install cannot pass unnoticed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

import speedtronic
from speedtronic import hookimpl
from speedtronic.hookspecs import Register
from speedtronic.plugins import PluginHost, get_plugin_host, registries, reset_plugin_host
from speedtronic.registry import PluginError

SRC = Path(speedtronic.__file__).resolve().parents[1]
INSTALL_HINT = "the example plugin is not installed; run: pip install -e plugins/speedtronic-example"


def require_example() -> None:
    """Fail (not skip) unless speedtronic-example is importable and registered as an entry point."""
    if importlib.util.find_spec("speedtronic_example") is None:
        pytest.fail(INSTALL_HINT)
    if not any(ep.value == "speedtronic_example.plugin" for ep in metadata.entry_points(group="speedtronic")):
        pytest.fail(f"speedtronic_example is importable but has no 'speedtronic' entry point; {INSTALL_HINT}")


@pytest.fixture
def fresh_host() -> Iterator[None]:
    """A clean process-wide plugin host for the test, and a clean one again afterwards."""
    reset_plugin_host()
    yield
    reset_plugin_host()


def cli_env(extra_path: Path | None = None, **extra: str) -> dict[str, str]:
    """Environment for a `python -m speedtronic` subprocess: this checkout's src first, no plugin settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPEEDTRONIC_")}
    paths = [str(SRC), *([str(extra_path)] if extra_path else []), os.environ.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return {**env, **extra}


def run_speedtronic(
    *args: str, extra_path: Path | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "speedtronic", *args],
        capture_output=True,
        text=True,
        env=cli_env(extra_path, **env),
        timeout=120,
    )


def plugins_json(result: subprocess.CompletedProcess[str]) -> list[dict[str, object]]:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])["plugins"]  # --json: the last stdout line


# -- discovery ----------------------------------------------------------------------------------------


def test_plugins_json_lists_the_example() -> None:
    require_example()
    listing = plugins_json(run_speedtronic("plugins", "--json"))
    entry = next((p for p in listing if p["name"] == "speedtronic-example"), None)
    assert entry is not None, listing
    assert entry["version"] == metadata.version("speedtronic-example")
    assert entry["builtin"] is False
    assert entry["hooks"] == ["register_hooks", "register_models"]
    assert entry["registers"] == {"models": ["example-gru", "example-mlp"], "hooks": ["csv"]}


def test_load_plugins_env_limits_what_loads() -> None:
    require_example()
    assert plugins_json(run_speedtronic("plugins", "--json", SPEEDTRONIC_LOAD_PLUGINS="")) == []
    # By distribution name or by entry-point name.
    for name in ("speedtronic-example", "example"):
        listing = plugins_json(run_speedtronic("plugins", "--json", SPEEDTRONIC_LOAD_PLUGINS=name))
        names = [p["name"] for p in listing]
        assert "speedtronic-example" in names


def test_help_with_plugins_loaded_does_not_import_torch() -> None:
    require_example()
    code = (
        "import sys\n"
        "from speedtronic.cli.app import build_app\n"
        "from speedtronic.plugins import registries\n"
        "build_app(); registries()\n"
        "assert 'torch' not in sys.modules, 'a plugin imported torch at load time'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=60
    )
    assert result.returncode == 0, result.stderr


# -- a plugin model through the registry ------------------------------------------------------------------


def test_plugin_model_trains_through_the_registry(fresh_host: None) -> None:
    require_example()
    import torch

    from speedtronic.config import ModelConfig
    from speedtronic.engine.batches import forward_loss

    factory = registries().models.get("example-gru")
    torch.manual_seed(0)
    model = factory(ModelConfig(name="example-gru", vocab_size=64, max_seq_len=32, d_model=32, n_layer=1))
    generator = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, 64, (4, 32), generator=generator),
        "labels": torch.randint(0, 64, (4, 32), generator=generator),
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(10):
        loss = forward_loss(model, batch, pass_labels=True)  # the trainer's own call
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses


# -- a broken plugin ------------------------------------------------------------------------------------


def make_broken_plugin(root: Path) -> Path:
    """An 'installed' plugin whose module raises ImportError: a fake dist-info plus the module."""
    site = root / "site"
    dist_info = site / "speedtronic_broken-0.0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: speedtronic-broken\nVersion: 0.0.1\n")
    (dist_info / "entry_points.txt").write_text("[speedtronic]\nbroken = speedtronic_broken_plugin\n")
    (site / "speedtronic_broken_plugin.py").write_text(
        'raise ImportError("speedtronic_broken_plugin needs a package that is not installed")\n'
    )
    return site


def test_a_broken_plugin_is_skipped_with_a_warning(tmp_path: Path) -> None:
    result = run_speedtronic("plugins", "--json", extra_path=make_broken_plugin(tmp_path))
    listing = plugins_json(result)  # exit 0 and valid JSON on the last line
    assert "speedtronic-broken" not in [p["name"] for p in listing]
    assert "speedtronic-broken" in result.stderr and "ImportError" in result.stderr


def test_strict_mode_turns_a_broken_plugin_into_an_error(tmp_path: Path) -> None:
    site = make_broken_plugin(tmp_path)
    result = run_speedtronic("plugins", "--json", extra_path=site, SPEEDTRONIC_STRICT_PLUGINS="1")
    assert result.returncode != 0
    assert "speedtronic-broken" in result.stderr


# -- plugins registered in-process --------------------------------------------------------------------------


class DirectPlugin:
    """A plugin object, as a test or notebook would register it without installing anything."""

    @hookimpl
    def register_models(self, register: Register) -> None:
        register("direct-model", lambda config: None)

    @hookimpl
    def register_hooks(self, register: Register) -> None:
        register("direct-hook", lambda config: None)


def test_a_plugin_registered_directly_then_unregistered(fresh_host: None) -> None:
    host = get_plugin_host()
    host.register(DirectPlugin(), name="direct")
    try:
        assert "direct-model" in registries().models and "direct-hook" in registries().hooks
        assert host.infos["direct"].registers == {"models": ["direct-model"], "hooks": ["direct-hook"]}
        assert "direct" in [p["name"] for p in host.describe()]
    finally:
        host.unregister("direct")
    assert "direct-model" not in registries().models


class ClaimsTheName:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    @hookimpl
    def register_models(self, register: Register) -> None:
        register(self.model_name, lambda config: None)


def test_two_plugins_registering_one_model_name_is_an_error_naming_both() -> None:
    host = PluginHost(load_installed=False)
    host.register(ClaimsTheName("twin"), name="first-plugin")
    host.register(ClaimsTheName("twin"), name="second-plugin")
    with pytest.raises(PluginError, match="'twin'") as error:
        host.registries()
    assert "first-plugin" in str(error.value) and "second-plugin" in str(error.value)


def test_claiming_the_example_model_name_conflicts_with_the_example(fresh_host: None) -> None:
    require_example()
    host = get_plugin_host()
    host.register(ClaimsTheName("example-gru"), name="copycat")
    try:
        with pytest.raises(PluginError) as error:
            host.registries()
        assert "speedtronic-example" in str(error.value) and "copycat" in str(error.value)
    finally:
        host.unregister("copycat")
