"""The plugin module speedtronic loads (entry point `speedtronic: example = "speedtronic_example.plugin"`).

It implements two hooks from `speedtronic.hookspecs`, each handed a `register(name, factory)` callback:

- register_models: "example-gru", a GRU language model (model.py) whose own settings come in
  `model.options`; and "example-mlp", a fixed-window MLP (mlp.py) with a typed config of its own
  (config.py: `register(name, factory, config=ContextMLPConfig)`); select with `model.name`.
- register_hooks: "csv", a CSV metrics writer (hooks.py); select with `logging.hooks`.

Keep this module light: speedtronic imports it for every command, `--help` included, so the factories
import model.py (and with it torch) only when a run actually builds the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from speedtronic import hookimpl

from speedtronic_example.config import ContextMLPConfig  # pydantic only: no torch

if TYPE_CHECKING:
    from speedtronic.config import Config, ModelConfig
    from speedtronic.hookspecs import Register

MODEL_NAME = "example-gru"
MLP_NAME = "example-mlp"
HOOK_NAME = "csv"


def gru_factory(config: ModelConfig) -> Any:
    from speedtronic_example.model import build_gru  # torch is imported here, on first use

    return build_gru(config)


def mlp_factory(config: ContextMLPConfig) -> Any:
    from speedtronic_example.mlp import build_mlp

    return build_mlp(config)


def csv_factory(config: Config) -> Any:
    from speedtronic_example.hooks import build_csv_hook

    return build_csv_hook(config)


@hookimpl
def register_models(register: Register) -> None:
    register(MODEL_NAME, gru_factory)
    register(MLP_NAME, mlp_factory, config=ContextMLPConfig)


@hookimpl
def register_hooks(register: Register) -> None:
    register(HOOK_NAME, csv_factory)
