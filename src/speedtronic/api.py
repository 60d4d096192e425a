"""The public Python API: `build_run` and a `Trainer` that use the installed plugins, and `train(config)`.

    from speedtronic import Trainer, build_run, load_config
    result = Trainer(load_config("configs/smoke.yaml")).train()
    run = build_run(load_config("configs/smoke.yaml"))   # every part built; Trainer(run).train()

The engine (engine/run.py, engine/trainer.py) is handed its registries and never looks for plugins
itself; these, like the CLI, hand it the installed plugins' registries unless told otherwise.
"""

from __future__ import annotations

from typing import Any

from speedtronic.config import Config
from speedtronic.engine.checkpoint.layout import RunCheckpoint
from speedtronic.engine.parallel.distributed import World
from speedtronic.engine.preflight.advice import advise_at_startup
from speedtronic.engine.run import Run
from speedtronic.engine.run import build_run as engine_build_run
from speedtronic.engine.trainer import Trainer as EngineTrainer
from speedtronic.engine.trainer import TrainResult
from speedtronic.registry import Registries


def installed_registries() -> Registries:
    """Models, optimizers and hooks of the built-ins and every installed plugin (SPEEDTRONIC_LOAD_PLUGINS
    limits which load)."""
    from speedtronic.plugins import registries

    return registries()


def build_run(
    config: Config,
    registries: Registries | None = None,
    world: World | None = None,
    resume: RunCheckpoint | bool | None = True,
    **parts: Any,
) -> Run:
    """`engine.run.build_run` with the installed plugins' registries by default: every part of the run
    `config` describes (and any parts given, used as they are), ready for `Trainer(run)`; a model built
    from the config gets the start-up advice (engine/preflight/advice.py)."""
    run = engine_build_run(config, registries or installed_registries(), world, resume, **parts)
    if parts.get("model") is None:
        advise_at_startup(run)
    return run


class Trainer(EngineTrainer):
    """`engine.trainer.Trainer` with the installed plugins' registries by default.

    Give it a built `Run`, or a config and any parts, used as given: `Trainer(config, model=…,
    optimizer=…, scheduler=…, train_data=…, val_data=…, hooks=…, sync=…, registries=…)`.
    """

    def __init__(self, config: Config | Run, *, registries: Registries | None = None, **parts: Any) -> None:
        built_here = not isinstance(config, Run)  # a built run has its registries and its advice already
        if built_here:
            registries = registries or installed_registries()
        super().__init__(config, registries=registries, **parts)
        if built_here and parts.get("model") is None:
            advise_at_startup(self.run)


def train(config: Config, **parts: Any) -> TrainResult:
    """Build a Trainer from `config` (and any parts given) and run it to the end of the run."""
    return Trainer(config, **parts).train()
