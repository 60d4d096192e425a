"""Speedtronic: fast, efficient language-model training, with DumbDiLoCo sync over the Hugging Face Hub.

The public API is small and imported lazily, so `import speedtronic` (and the CLI's `--help`) never
imports torch:

    from speedtronic import Trainer, load_config
    config = load_config("configs/smoke.yaml")
    result = Trainer(config).train()          # or Trainer(config, model=…, optimizer=…, scheduler=…)

    from speedtronic import plan_run, load_run   # the derived run plan; a checkpoint's model back
    from speedtronic import build_run, Run       # every part of a run, built: Trainer(build_run(config))
"""

from __future__ import annotations

import importlib
from typing import Any

from speedtronic.hookspecs import hookimpl

__version__ = "0.1.0"

_LAZY = {
    "Config": "speedtronic.config",
    "load_config": "speedtronic.config",
    "RunPlan": "speedtronic.plan",
    "Run": "speedtronic.engine.run",
    "build_run": "speedtronic.api",
    "plan_run": "speedtronic.plan",
    "Trainer": "speedtronic.api",
    "TrainResult": "speedtronic.engine.trainer",
    "train": "speedtronic.api",
    "installed_registries": "speedtronic.api",
    "Sync": "speedtronic.engine.sync",
    "load_run": "speedtronic.engine.checkpoint.load_run",
    "get_plugin_host": "speedtronic.plugins",
}

__all__ = [
    "Config",
    "Run",
    "RunPlan",
    "Sync",
    "TrainResult",
    "Trainer",
    "__version__",
    "build_run",
    "get_plugin_host",
    "hookimpl",
    "installed_registries",
    "load_config",
    "load_run",
    "plan_run",
    "train",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'speedtronic' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
