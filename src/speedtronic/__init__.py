"""Speedtronic: fast, efficient language-model training, with DumbDiLoCo sync over the Hugging Face Hub.

The public API is small and imported lazily, so `import speedtronic` (and the CLI's `--help`) never
imports torch:

    from speedtronic import load_config, train
    result = train(load_config("configs/smoke.yaml"))
"""

from __future__ import annotations

import importlib
from typing import Any

from speedtronic.hookspecs import hookimpl

__version__ = "0.1.0"

_LAZY = {
    "Config": "speedtronic.config",
    "load_config": "speedtronic.config",
    "Trainer": "speedtronic.engine.trainer",
    "train": "speedtronic.engine.trainer",
    "get_plugin_host": "speedtronic.plugins",
}

__all__ = ["Config", "Trainer", "__version__", "get_plugin_host", "hookimpl", "load_config", "train"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'speedtronic' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
