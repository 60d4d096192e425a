"""The public Python API: a `Trainer` that uses the installed plugins, and `train(config)`.

    from speedtronic import Trainer, load_config
    result = Trainer(load_config("configs/smoke.yaml")).train()

The engine's Trainer (engine/trainer.py) is handed its registries and never looks for plugins
itself; this one, like the CLI, hands it the installed plugins' registries unless told otherwise.
"""

from __future__ import annotations

from typing import Any

from speedtronic.config import Config
from speedtronic.engine.trainer import Trainer as EngineTrainer
from speedtronic.engine.trainer import TrainResult
from speedtronic.registry import Registries


def installed_registries() -> Registries:
    """Models, optimizers and hooks of the built-ins and every installed plugin (SPEEDTRONIC_LOAD_PLUGINS
    limits which load)."""
    from speedtronic.plugins import registries

    return registries()


class Trainer(EngineTrainer):
    """`engine.trainer.Trainer` with the installed plugins' registries by default.

    Every part is optional and used as given: `Trainer(config, model=…, optimizer=…, scheduler=…,
    train_data=…, val_data=…, hooks=…, sync=…, registries=…)`.
    """

    def __init__(self, config: Config, *, registries: Registries | None = None, **parts: Any) -> None:
        super().__init__(config, registries=registries or installed_registries(), **parts)


def train(config: Config, **parts: Any) -> TrainResult:
    """Build a Trainer from `config` (and any parts given) and run it to the end of the run."""
    return Trainer(config, **parts).train()
