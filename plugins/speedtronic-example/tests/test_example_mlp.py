"""Tests of example-mlp: a plugin model with a typed config (config.py) and a forward(tokens) -> logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from speedtronic import Trainer, load_config
from speedtronic.errors import ConfigError
from speedtronic.plugins import PluginHost

import speedtronic_example.plugin as plugin
from speedtronic_example.config import ContextMLPConfig
from speedtronic_example.mlp import ContextMLP


def registries():
    host = PluginHost(load_installed=False)  # only the built-ins, plus this module
    host.register(plugin, name="example-under-test")
    return host.registries()


def test_the_model_section_is_its_typed_config() -> None:
    config = load_config({"model": {"name": "example-mlp", "context": 3}}, registries=registries())
    assert type(config.model) is ContextMLPConfig
    assert (config.model.context, config.model.hidden_size) == (3, 128)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"context": 0}, "invalid config: model.context: Input should be greater than 0"),
        ({"hidden_size": "wide"}, "invalid config: model.hidden_size: Input should be a valid integer"),
        (
            {"hiden_size": 8},
            "invalid config: model.hiden_size: unknown key; did you mean 'model.hidden_size'?",
        ),
        (
            {"context": 9, "max_seq_len": 8},
            "invalid config: model.context (9) exceeds model.max_seq_len (8); lower model.context",
        ),
    ],
)
def test_a_bad_field_is_one_line_naming_it(model: dict, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config({"model": {"name": "example-mlp", **model}}, registries=registries())
    text = str(error.value)
    assert text.startswith(message) and "\n" not in text


def test_forward_sees_only_its_window() -> None:
    torch.manual_seed(0)
    model = ContextMLP(vocab_size=16, context=2, embed_size=4, hidden_size=8)
    tokens = torch.randint(0, 16, (1, 6))
    changed = tokens.clone()
    changed[0, 0] = (tokens[0, 0] + 1) % 16  # token 0 is outside the window of positions 2..5
    a, b = model(tokens), model(changed)
    assert a.shape == (1, 6, 16)
    assert torch.equal(a[0, 2:], b[0, 2:]) and not torch.equal(a[0, :2], b[0, :2])


def test_it_trains_through_the_public_trainer(tmp_path: Path) -> None:
    config = load_config(
        {
            "run": {"max_steps": 30, "log_every": 10, "eval_every": 0, "output_dir": str(tmp_path)},
            "model": {"name": "example-mlp", "context": 2, "hidden_size": 32},
            "data": {"synthetic": True, "vocab_size": 32, "num_tokens": 20_000, "block_size": 16},
            "optimizer": {"lr": 1e-2},
            "checkpoint": {"enabled": False},
            "logging": {"hooks": []},
        },
        registries=registries(),
    )
    result = Trainer(config, registries=registries(), progress=False).train()
    assert result.final_loss is not None and result.final_loss < torch.log(torch.tensor(32.0)).item()
