"""Tests of the plugin module (plugin.py): what it registers, and that loading it stays torch-free."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from speedtronic.config import ModelConfig, load_config
from speedtronic.plugins import PluginHost

import speedtronic_example.plugin as plugin


def test_registers_its_model_and_hook_through_a_plugin_host(tmp_path: Path) -> None:
    host = PluginHost(load_installed=False)  # only the built-ins, plus this module
    host.register(plugin, name="example-under-test")
    registries = host.registries()
    assert "example-gru" in registries.models and "csv" in registries.hooks
    assert host.infos["example-under-test"].registers == {
        "models": ["example-gru", "example-mlp"],
        "hooks": ["csv"],
    }
    model = registries.models.get("example-gru")(
        ModelConfig(name="example-gru", vocab_size=16, max_seq_len=8)
    )
    assert isinstance(model, torch.nn.Module)
    hook = registries.hooks.get("csv")(load_config({"run": {"output_dir": str(tmp_path)}}))
    hook.close()
    assert (tmp_path / "metrics.csv").exists()


def test_importing_the_plugin_does_not_import_torch() -> None:
    # speedtronic imports every plugin for `--help`; torch must wait for the model factory.
    code = "import sys, speedtronic_example.plugin; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
