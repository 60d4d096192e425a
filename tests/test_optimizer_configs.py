"""Typed optimizer configs: a plugin optimizer registered with `register(name, factory, config=Cls)` gets
its `optimizer:` section validated by Cls (its own fields, defaults and rules, errors naming the dotted
field), its factory receives a Cls, and the built-in optimizers keep the plain `OptimizerConfig`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import Field
from torch import nn

from speedtronic import Trainer, hookimpl, load_config
from speedtronic.config import OptimizerConfig
from speedtronic.engine.optimizer import build_optimizer
from speedtronic.errors import ConfigError
from speedtronic.plugins import PluginHost
from speedtronic.registry import PluginError, Registries


class HeavyBallConfig(OptimizerConfig):
    """SGD with heavy-ball momentum: two settings of its own, with their rules."""

    momentum: float = Field(0.9, ge=0, lt=1, description="Heavy-ball momentum.")
    dampening: float = Field(0.0, ge=0, le=1, description="Dampening of the momentum.")


SEEN: list[OptimizerConfig] = []


def heavy_ball(model: nn.Module, config: HeavyBallConfig) -> torch.optim.Optimizer:
    SEEN.append(config)
    return torch.optim.SGD(
        model.parameters(), lr=config.lr, momentum=config.momentum, dampening=config.dampening
    )


class HeavyBallPlugin:
    @hookimpl
    def register_optimizers(self, register: Any) -> None:
        register("heavy-ball", heavy_ball, config=HeavyBallConfig, state_elements=1)


def plugin_registries() -> Registries:
    host = PluginHost(load_installed=False)
    host.register(HeavyBallPlugin(), name="heavy-ball-plugin")
    return host.registries()


def write_config(tmp_path: Path, optimizer: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(
        f"""
run: {{name: typed, max_steps: 3, log_every: 1, eval_every: 0, output_dir: {tmp_path}}}
model: {{n_layer: 1, n_head: 2, d_model: 16}}
data: {{synthetic: true, vocab_size: 64, num_tokens: 4000, block_size: 8, micro_batch_size: 4, val_batches: 1}}
optimizer: {optimizer}
checkpoint: {{enabled: false}}
logging: {{hooks: []}}
"""
    )
    return path


def test_a_plugin_optimizer_section_is_validated_by_its_own_config_class(tmp_path: Path) -> None:
    registries = plugin_registries()
    path = write_config(tmp_path, "{name: heavy-ball, lr: 0.05, momentum: 0.5}")
    config = load_config(path, registries=registries)
    assert type(config.optimizer) is HeavyBallConfig
    assert (config.optimizer.momentum, config.optimizer.dampening, config.optimizer.lr) == (0.5, 0.0, 0.05)
    assert config.to_dict()["optimizer"]["momentum"] == 0.5  # dumped with the plugin's fields

    with pytest.raises(ConfigError, match=r"optimizer\.momentum"):
        load_config(write_config(tmp_path, "{name: heavy-ball, momentum: 1.5}"), registries=registries)
    with pytest.raises(ConfigError, match=r"optimizer\.momentum"):  # `--set` goes through the same class
        load_config(path, ["optimizer.momentum=-1"], registries=registries)
    with pytest.raises(ConfigError, match="momentum"):  # the built-in adamw has no such setting
        load_config(write_config(tmp_path, "{name: adamw, momentum: 0.5}"), registries=registries)


def test_the_factory_receives_its_typed_config_and_the_run_trains(tmp_path: Path) -> None:
    registries = plugin_registries()
    config = load_config(write_config(tmp_path, "{name: heavy-ball, momentum: 0.25}"), registries=registries)
    SEEN.clear()
    result = Trainer(config, registries=registries, progress=False).train()
    assert result.steps == 3 and result.optimizer == "heavy-ball"
    assert [type(c) for c in SEEN] == [HeavyBallConfig] and SEEN[0].momentum == 0.25


def test_a_section_loaded_without_the_plugin_is_validated_again_when_built(tmp_path: Path) -> None:
    # Loaded with the built-ins only, the section is a plain OptimizerConfig, which forbids unknown keys:
    # it is the name alone, so the plugin's defaults apply when the optimizer is built with its registries.
    plain = load_config(write_config(tmp_path, "heavy-ball"), registries=Registries())
    assert type(plain.optimizer) is OptimizerConfig
    SEEN.clear()
    optimizer = build_optimizer(plain, nn.Linear(2, 2), plugin_registries())
    assert type(SEEN[0]) is HeavyBallConfig and optimizer.param_groups[0]["momentum"] == 0.9


def test_built_in_optimizers_keep_the_plain_section(tmp_path: Path) -> None:
    for name in ("adamw", "muon", "muon_plus"):
        config = load_config(write_config(tmp_path, name))
        assert type(config.optimizer) is OptimizerConfig


def test_an_optimizer_config_must_extend_optimizer_config() -> None:
    class Bad:
        @hookimpl
        def register_optimizers(self, register: Any) -> None:
            register("bad", heavy_ball, config=dict)

    host = PluginHost(load_installed=False)
    host.register(Bad(), name="bad-plugin")
    with pytest.raises(PluginError, match=r"config= must be a subclass of .*OptimizerConfig"):
        host.registries()
